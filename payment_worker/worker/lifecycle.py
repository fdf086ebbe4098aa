"""What a worker process runs beside its task slots (the sweeper thread, the liveness
heartbeat) and what it does when it is told to stop (hand its accounts back).

Celery imports this module in every worker (it is in the app's ``include`` list), which
connects the receivers below; they start a :class:`~payment_worker.worker.sweeper.SweeperThread`
in each process that runs tasks and stop it at shutdown:

* prefork (WORKER_POOL=prefork): in each forked child (``worker_process_init``), never in the
  parent, which forks new children all along (``worker_max_tasks_per_child``) and must not
  fork with a thread of its own inside a database or Redis call;
* threads (the default pool) and solo: in the worker process itself, once its pool has started
  (``worker_ready``; solo already sends ``worker_process_init`` in-process).

Why a thread and not a message: see :mod:`payment_worker.worker.sweeper` and the Sweeper
section of docs/processing.md. The thread is found again through ``threading.enumerate()``:
this module keeps no state of its own.

At start (``worker_init``, before the pool, so prefork children inherit it) the process's
soft limit of open files is raised to its hard limit (:mod:`payment_worker.ops.open_files`):
500 task slots at 1 s gateway latency held about 1,000 files (measured), the default soft
limit of many systems, and the default is 1,000.

Once a process is ready to run tasks, Celery's result-backend lookup is done once
(:func:`warm_result_backend`), then its heap as it stands is frozen out of the cyclic
collector's reach (:func:`freeze_heap`): a full collection then walks what the tasks made,
not the whole of Celery and SQLAlchemy.

The same receivers start the process's liveness heartbeat (:mod:`payment_worker.locks.liveness`)
before the first task, and stop it at the very end, deleting the key, so a lock left behind
is taken over at once.

**Warm shutdown** (SIGTERM, or ``celery control shutdown``): Celery stops consuming and waits
for the running tasks. ``worker_shutting_down`` (SIGTERM, SIGINT) or the worker blueprint's
close (:class:`HandBackOnStop`, every way a worker stops), in the worker's main process as
soon as the shutdown begins, sets the runtime's ``shutting_down`` event, and every
drain hands its account back at its next safe point (between two items, after recording what
it learnt): it gives the untouched items back, releases the lock and re-enqueues the account,
so another worker continues it within seconds instead of after a 10 s slice (or, for a
killed worker, after the lock's TTL). With the prefork pool the signal reaches the parent
only: its children finish their slice as before (the threads pool is the default).
"""

from __future__ import annotations

import gc
import resource
import threading
from typing import Any

from celery import bootsteps
from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from payment_worker import runtime
from payment_worker.db.engine import open_pool
from payment_worker.db.retry import short_error
from payment_worker.ops.logging import get_logger
from payment_worker.ops.open_files import files_needed, raise_open_files_limit
from payment_worker.redis_pool import ShardedConnectionPool
from payment_worker.worker.celery_app import app
from payment_worker.worker.sweeper import SweeperThread

log = get_logger("worker")


def _running() -> list[SweeperThread]:
    return [t for t in threading.enumerate() if isinstance(t, SweeperThread) and t.is_alive()]


def start_sweeper() -> SweeperThread:
    """This process's sweeper thread, started if it is not running yet."""
    running = _running()
    if running:
        return running[0]
    rt = runtime.current()
    thread = SweeperThread(runtime.current, rt.settings.sweeper_interval)
    thread.start()
    log.info("sweeper_thread_started", interval=rt.settings.sweeper_interval)
    return thread


def stop_sweeper(timeout: float = 5.0) -> None:
    """Stop this process's sweeper thread (a pass in progress gets ``timeout`` seconds)."""
    for thread in _running():
        thread.stop(timeout)


def _runs_tasks_here(pool: Any) -> bool:
    """Whether the worker's own process runs tasks (every pool but prefork)."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    return not isinstance(pool, PreforkPool)


def start_liveness() -> None:
    """Start this process's heartbeat now, so the first lock does not wait for a beat."""
    rt = runtime.current()
    if not rt.liveness.start():
        log.warning("liveness_not_established", holder=rt.liveness.holder_id)


def raise_files_limit(sender: Any = None, **_: Any) -> None:
    """Raise the soft limit of open files to the hard one; a limit still below what the
    worker's slots may need is logged (a socket that cannot be opened fails a call)."""
    slots = int(getattr(sender, "concurrency", 0) or 0)
    limit = raise_open_files_limit()
    needed = files_needed(slots)
    if limit != resource.RLIM_INFINITY and limit < needed:
        log.warning(
            "open_files_limit_low",
            limit=limit,
            needed=needed,
            slots=slots,
            hint="raise the hard limit: ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=",
        )


def check_pooler_timeouts(**_: Any) -> None:
    """Behind PgBouncer (``DB_PGBOUNCER``) the service cannot send its statement and lock
    timeouts: log each one the server's sessions leave looser than the settings want (a
    blocked statement would then hold its account for longer, or for ever). Once, at
    worker start; a database that cannot be read now is logged, not fatal (the drains
    retry)."""
    from payment_worker.db.engine import ConnectionLimits, loose_server_timeouts

    rt = runtime.current()
    if not rt.settings.db_pgbouncer:
        return
    try:
        # the autocommit view: one round trip, no BEGIN/ROLLBACK around the read
        with rt.autocommit_engine.connect() as conn:
            loose = loose_server_timeouts(conn, ConnectionLimits.from_settings(rt.settings))
    except Exception as exc:  # a start-up check never stops the worker
        log.warning("db_timeouts_not_checked", error=f"{type(exc).__name__}: {exc}")
        return
    for t in loose:
        log.warning(
            "db_timeout_loose",
            setting=t.name,
            server_ms=t.server_ms,
            wanted_ms=t.wanted_ms,
            hint=f"ALTER ROLE <role> SET {t.name} = '{t.wanted_ms}ms' (docs/configuration.md)",
        )


def freeze_heap() -> int | None:
    """Collect once, then move every object alive now (modules, Celery, the runtime's
    engines and pools: about 130,000 in a worker) out of the collector's reach; returns
    how many, or None when this process had frozen its heap already (the solo pool sends
    both signals below). Called once a process is ready to run tasks.

    Why: a full collection walks every tracked object; in a worker with hundreds of task
    threads three of them in a 5 s run held the GIL for up to 177 ms each, every account of
    the process stopped meanwhile (issue 13, docs/benchmarks.md). What is frozen lives as long
    as the process anyway; garbage made later is collected as before."""
    if gc.get_freeze_count():
        return None
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def warm_result_backend(app: Any) -> None:
    """Build the app's result backend now, before the first task, so that Celery's scan of
    the installed packages for backend entry points is done (and cached) once.

    Why: Celery builds the backend lazily, at the first task end that records a result
    (ignored here, but asked for all the same), and a backend not flagged thread-safe once
    per thread. The lookup behind it, ``load_extension_class_names``, reads every installed
    package's entry points (about 3 ms alone) and is cached only once one call has
    returned: the first burst of task ends in a fresh threads worker ran it in every thread
    at once. With 750 threads that was seconds of CPU and a GIL convoy (a task that only
    sleeps cost 4 to 20 ms of worker CPU instead of 0.5, issue 13, docs/benchmarks.md). The
    config flags our disabled backend thread-safe, so this one instance serves every
    thread."""
    _ = app.backend


def _child_started(**_: Any) -> None:
    """This process is ready to run tasks (a prefork child, or the worker itself below)."""
    from payment_worker.worker.celery_app import app

    start_liveness()
    start_sweeper()
    warm_result_backend(app)
    frozen = freeze_heap()
    if frozen is not None:
        log.info("heap_frozen", objects=frozen)


def prestart_threads(pool: Any) -> int | None:
    """Start every thread of a threads pool now; returns how many threads it has, or None
    when ``pool`` is no threads pool (or its executor has no thread to add).

    Why: Python's ``ThreadPoolExecutor`` starts a thread on a submit that finds none idle,
    and ``Thread.start`` waits until the new thread runs. Celery submits from the consumer's
    thread, the one that takes every message, so during a burst (a fresh worker at 1 s
    gateway latency: issue 13's scenario 5) each message waited for a thread start among
    hundreds of busy threads. The executor's own ``_adjust_thread_count`` (private, stable
    since Python 3.8) adds one idle thread per call without queueing any work, so no task
    can wait behind this; the threads cost memory (about 80 KB each), not CPU."""
    executor = getattr(pool, "executor", None)
    adjust = getattr(executor, "_adjust_thread_count", None)
    limit = getattr(executor, "_max_workers", None)
    threads = getattr(executor, "_threads", None)
    if adjust is None or not isinstance(limit, int) or threads is None:
        return None
    while len(threads) < limit:
        before = len(threads)
        adjust()
        if len(threads) == before:  # a task ran meanwhile and left a thread idle: enough
            break
    return len(threads)


def open_connections(rt: runtime.Runtime, slots: int) -> tuple[int, int] | None:
    """Open the process's Postgres pool and a Redis connection per 10 task ``slots`` (at
    least one) now; returns how many of each, or None when a server did not answer (the
    connections then open as the tasks need them, as they would have anyway).

    Why: in a fresh worker met by a burst of accounts, the task threads opened both among
    themselves, each connection about 1 ms of CPU with the cores already saturated: in
    issue 13's scenario 4 the workers spent about a tenth less CPU per item with them opened
    before the first task (docs/benchmarks.md, "Thirtieth session")."""
    pool = rt.redis.connection_pool
    try:
        opened = (
            pool.open_idle(max(1, slots // 10)) if isinstance(pool, ShardedConnectionPool) else 0
        )
        return opened, open_pool(rt.engine)
    except Exception as exc:  # a server not up yet: the first tasks open what they need
        # the first line only: SQLAlchemy's errors go on with a link to its docs
        log.warning("connections_not_opened", error=f"{type(exc).__name__}: {short_error(exc)}")
        return None


def _worker_ready(sender: Any = None, **_: Any) -> None:
    pool = getattr(sender, "pool", None)
    if not _runs_tasks_here(pool):
        return  # prefork: the children are ready on their own (worker_process_init)
    rt = runtime.current()
    if rt.settings.worker_prestart_threads:
        started = prestart_threads(pool)
        if started is not None:
            log.info("threads_prestarted", threads=started)
    if rt.settings.worker_open_connections:
        opened = open_connections(rt, int(getattr(pool, "limit", None) or 1))
        if opened is not None:
            log.info("connections_opened", redis=opened[0], postgres=opened[1])
    _child_started()


def hand_back_on_shutdown(**_: Any) -> None:
    """A warm shutdown began: drains of this process hand their accounts back at once."""
    rt = runtime.current()
    if not rt.shutting_down.is_set():
        rt.shutting_down.set()
        log.info("worker_handing_back", holder=rt.liveness.holder_id)


class HandBackOnStop(bootsteps.StartStopStep):  # type: ignore[misc]
    """Every way a worker stops closes its blueprint before any step stops, the pool's wait
    for the running tasks included: the drains hand their accounts back then. Celery sends
    ``worker_shutting_down`` only from its SIGTERM and SIGINT handlers, not for
    ``celery control shutdown``, where the drains ran their slices out."""

    requires = ("celery.worker.components:Pool",)

    def close(self, parent: Any) -> None:
        hand_back_on_shutdown()


def _stopping(**_: Any) -> None:
    stop_sweeper()
    # every task has ended: nothing of ours may be trusted any more, and a lock left behind
    # (a task killed by its time limit) is taken over at once
    runtime.current().liveness.stop()


# connected when Celery imports this module (plain calls: Celery's decorators are untyped)
worker_init.connect(raise_files_limit)
worker_init.connect(check_pooler_timeouts)
worker_process_init.connect(_child_started)
worker_ready.connect(_worker_ready)
worker_process_shutdown.connect(_stopping)
worker_shutdown.connect(_stopping)
worker_shutting_down.connect(hand_back_on_shutdown)
app.steps["worker"].add(HandBackOnStop)
