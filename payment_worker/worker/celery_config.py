"""Celery's configuration, built from the settings when Celery first needs it (so importing the
package starts no server). Every reliability setting is deliberate; tests/unit/test_celery_config.py
pins them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kombu import Exchange, Queue

from payment_worker.ops.multiprocess import concurrency_on_command_line, pool_on_command_line
from payment_worker.settings import Settings
from payment_worker.worker.broker_transport import transport_for


def build_config(s: Settings, broker_url: str, argv: Sequence[str] = ()) -> dict[str, Any]:
    """The Celery settings of the service, for the broker at ``broker_url``; ``argv``: the
    process's command line (an explicit ``-P`` there decides the pool)."""
    pool = pool_on_command_line(list(argv)) or s.worker_pool
    # the slots this process runs: an explicit -c wins over worker_concurrency
    slots = concurrency_on_command_line(list(argv)) or s.concurrency_for(pool)
    return {
        "broker_url": broker_url,
        # kombu's Redis transport, its client reused instead of built per ack (broker_transport.py)
        "broker_transport": transport_for(broker_url),
        # The plain `celery -A payment_worker worker` is the recommended command: pool and task
        # slots come from WORKER_POOL / WORKER_CONCURRENCY (threads at high concurrency by
        # default: a slot mostly waits on the gateway). -c on the command line wins, and so does
        # -P, except `-P prefork`, which Celery cannot tell from its own default (set
        # WORKER_POOL=prefork instead). Which settings below apply to which pool:
        # docs/configuration.md, "Worker pool".
        "worker_pool": pool,
        "worker_concurrency": s.concurrency_for(pool),
        # Postgres is the source of truth for outcomes; Celery results would only be a second copy.
        "task_ignore_result": True,
        "result_backend": None,
        # ... so the backend is Celery's disabled one, which keeps no state: one instance for
        # every thread, not one built at each task thread's first task end (lifecycle.py)
        "result_backend_thread_safe": True,
        # Ack only after the task has run: a worker that dies mid-batch leaves the message to be
        # redelivered, and the batch resumes from Postgres state (the work is idempotent).
        "task_acks_late": True,
        # A child killed by SIGKILL/OOM must requeue its message, not ack it as failed.
        "task_reject_on_worker_lost": True,
        # One message reserved per task slot (multiplier x concurrency): a slow batch never hides
        # others behind it.
        "worker_prefetch_multiplier": 1,
        # The Redis transport redelivers an unacked message after the visibility timeout. It must be
        # larger than the longest task and any countdown/ETA, or a running or delayed batch would be
        # delivered twice. The same value for the result transport, so the two never disagree.
        "broker_transport_options": {
            "visibility_timeout": s.visibility_timeout,
            # kombu's Redis pool (acks and publishes from every task thread): kombu's 10 is
            # a hard cap with redis-py 8 (MaxConnectionsError past it, not a wait), so it
            # follows the task slots; connections are only made when used at once
            "max_connections": max(100, 2 * slots),
            "socket_timeout": 10,
            "socket_connect_timeout": 5,
            "health_check_interval": 10,
            # messages taken per wake-up, BRPOP's included (worker/broker_transport.py)
            "take_batch": s.broker_take_batch,
        },
        "result_backend_transport_options": {"visibility_timeout": s.visibility_timeout},
        # Hard limits below the visibility timeout: a stuck task is killed before the broker
        # would redeliver it behind its back (Celery counts it failed and acks its message: the
        # sweeper sends the account on once the child's liveness lapses). Enforced by the
        # prefork pool only (threads and solo ignore them): there, a holder blocked anywhere is
        # given up by its watchdog after LOCK_MAX_STALL_SECONDS (docs/processing.md).
        "task_time_limit": s.task_time_limit,
        "task_soft_time_limit": s.task_soft_time_limit,
        # On a lost broker connection, running tasks run on (their messages come back and
        # meet the held account lock; the lock and its fence keep two holders apart).
        # Cancelling them SIGTERMs prefork children, which die mid-drain: an item whose
        # request had just left is put in doubt and its lock waits for liveness to lapse,
        # every running drain at once on one Redis blip. (Threads cannot be cancelled.)
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_connection_retry_on_startup": True,
        # Publishing must fail fast when the broker is down: the producer has already persisted the
        # batch, and the sweeper will enqueue it later.
        "broker_connection_timeout": 5,
        # ... also for a publisher waiting for one of the process's producers (Celery's pool,
        # broker_pool_limit, 10) while others retry against a broker that does not answer.
        # kombu takes a producer's connection with no bound of its own, so enqueue_batch
        # bounds the wait itself (worker/queueing.py, PUBLISH_WAIT_SECONDS)
        "broker_pool_acquire_timeout": 5.0,
        "task_publish_retry_policy": {
            "max_retries": 2,
            "interval_start": 0.1,
            "interval_step": 0.2,
        },
        "task_queues": (
            Queue("payments", Exchange("payments"), routing_key="payments"),
            Queue("dlq", Exchange("dlq"), routing_key="dlq"),
        ),
        "task_default_queue": "payments",
        "task_default_exchange": "payments",
        "task_default_routing_key": "payments",
        "task_routes": {
            "payment_worker.process_account_batch": {
                "queue": "payments",
                "routing_key": "payments",
            },
            "payment_worker.sweep": {"queue": "payments", "routing_key": "payments"},
            "payment_worker.dlq.*": {"queue": "dlq", "routing_key": "dlq"},
        },
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_hijack_root_logger": False,
        # Recycle a prefork child now and then, so a slow leak in it is bounded (the threads
        # pool, the default, ignores it: docs/configuration.md).
        "worker_max_tasks_per_child": 2000,
        "worker_send_task_events": s.worker_task_events,
        "task_send_sent_event": s.worker_task_events,
        "beat_schedule": {
            "sweep": {
                "task": "payment_worker.sweep",
                "schedule": s.sweeper_interval,
                # an old sweep message is useless: the next tick sends a fresh one
                "options": {"expires": max(s.sweeper_interval * 2, 5.0)},
            },
        },
    }
