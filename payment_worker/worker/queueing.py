"""Putting accounts' work on the queue: publish, hand off at the end of a slice, schedule,
and the "work waiting" mark a holder checks after it releases.

The drain loop and the sweeper both use this module; it publishes by task name, so it needs
neither the tasks module nor anything that imports it (no import cycle).
"""

from __future__ import annotations

from payment_worker.ops.logging import get_logger
from payment_worker.runtime import Runtime
from payment_worker.worker.celery_app import app

log = get_logger("queueing")

PROCESS_TASK = "payment_worker.process_account_batch"
SWEEP_TASK = "payment_worker.sweep"
PAYMENTS_QUEUE = "payments"


def enqueue_batch(batch_id: str, countdown: float | None = None) -> None:
    """Publish one ``process_account_batch`` message carrying only the batch id.

    Raises the broker's error when it is unreachable; callers that have persisted the batch
    already may ignore it, because the sweeper enqueues pending batches.
    """
    app.send_task(
        PROCESS_TASK,
        args=[batch_id],
        queue=PAYMENTS_QUEUE,
        routing_key=PAYMENTS_QUEUE,
        countdown=countdown,
    )


def hand_off(account_id: str, batch_id: str) -> None:
    """End of a slice: the account goes back to the queue (after the lock is released, so the
    next execution finds it free), and any free worker in any process continues it while
    other accounts get their turn."""
    try:
        enqueue_batch(batch_id)
    except Exception as exc:
        # broker down: the sweeper re-enqueues stalled accounts
        log.warning("hand_off_failed", account_id=account_id, error=repr(exc))


def schedule(rt: Runtime, account_id: str, batch_id: str, wait: float) -> float:
    """One delayed message per account for work that is not due yet; returns the countdown."""
    # a countdown must stay below the broker's visibility timeout (or the message would be
    # redelivered while still waiting); if a Retry-After is longer, the task runs early, finds
    # nothing due and schedules again
    wait = min(max(wait, 0.0), rt.settings.visibility_timeout * 0.5)
    marker = rt.keys.scheduled(account_id)
    # the marker outlives the countdown a little; the sweeper covers a lost delayed message
    if rt.redis.set(marker, batch_id, nx=True, px=int((wait + 5.0) * 1000)):
        try:
            enqueue_batch(batch_id, countdown=wait or None)
        except Exception as exc:
            rt.redis.delete(marker)
            log.warning("schedule_failed", account_id=account_id, error=repr(exc))
    return wait


class RedisAccountQueue:
    """The drain loop's :class:`~payment_worker.worker.ports.AccountQueue`: marks in Redis,
    messages through the broker."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        # a mark outlives a holder's slice by far: a task that found the lock busy must not
        # have its work forgotten while the holder drains
        self._mark_ms = rt.settings.lock_ttl_ms * 4

    def announce(self, account_id: str, batch_id: str) -> None:
        """Leave the "work waiting" mark of the account."""
        self._rt.redis.set(self._rt.keys.waiting(account_id), batch_id, px=self._mark_ms)

    def consume(self, account_id: str) -> None:
        """Clear the mark."""
        self._rt.redis.delete(self._rt.keys.waiting(account_id))

    def announced(self, account_id: str) -> bool:
        """Whether a task left the mark again."""
        return bool(self._rt.redis.exists(self._rt.keys.waiting(account_id)))

    def hand_off(self, account_id: str, batch_id: str) -> None:
        """See :func:`hand_off`."""
        hand_off(account_id, batch_id)

    def schedule(self, account_id: str, batch_id: str, wait: float) -> float:
        """See :func:`schedule`."""
        return schedule(self._rt, account_id, batch_id, wait)
