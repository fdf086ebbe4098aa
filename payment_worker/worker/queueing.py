"""Putting accounts' work on the queue: publish, hand off at the end of a slice, schedule,
and the "work waiting" mark a holder checks after it releases.

The drain loop and the sweeper both use this module; it publishes by task name, so it needs
neither the tasks module nor anything that imports it (no import cycle).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Any

from payment_worker import lua
from payment_worker.errors import PaymentWorkerError
from payment_worker.locks.arrival import Arrival
from payment_worker.ops.logging import get_logger
from payment_worker.redis_pool import UNREACHABLE
from payment_worker.runtime import Runtime
from payment_worker.worker.celery_app import app

log = get_logger("queueing")

PROCESS_TASK = "payment_worker.process_account_batch"
SWEEP_TASK = "payment_worker.sweep"
PAYMENTS_QUEUE = "payments"
# the keyword argument of a delayed message: the due time its marker holds (ms, Redis clock)
SCHEDULED_DUE_KWARG = "scheduled_due_ms"
# the header of every message we publish: when it was published (ms since the epoch); the
# sweeper reads it off the oldest waiting message to know how long messages wait
ENQUEUED_HEADER = "pw_enqueued_ms"
# the batch's account, when the publisher knows it (it always does but for a bare batch id
# sent by hand): the task then needs no query to find it. A header, not an argument: a
# worker of an older version ignores it (an unknown keyword argument would fail its task)
ACCOUNT_HEADER = "pw_account_id"
# a scheduled marker outlives its message's due time by this much (a lost delayed message
# blocks no reschedule for longer; the sweeper covers it)
SCHEDULE_SLACK_MS = 5000
# a new delayed message replaces the one on its way only when due this much earlier: two
# reschedules for the same item (their delays differ by the time between the readings) must
# not publish twice
SCHEDULE_EARLIER_BY_MS = 1000

# KEYS = [the account's scheduled marker]; headers in the files
_CLAIM_LUA = lua.load("schedule_claim")
_CLEAR_LUA = lua.load("schedule_clear")
_MARK_LUA = lua.load("queued_mark")

# How long a publish waits for one of the process's broker connections before it gives up
# as "not published". Celery publishes through a pool of broker_pool_limit (10) producers,
# and kombu takes a producer's connection with no time bound: with a broker that does not
# answer, each publish holds one for its retries (seconds), and hundreds of task threads
# (hand-offs, delayed messages under the lock) would queue behind them without end.
PUBLISH_WAIT_SECONDS = 5.0


class PublishBusy(PaymentWorkerError):
    """Every broker connection of the process stayed busy for PUBLISH_WAIT_SECONDS."""


class _PublishSlots:
    """At most broker_pool_limit publishes of this process at once, the others waiting for
    a slot PUBLISH_WAIT_SECONDS at most (new after a fork: a parent's holders are not the
    child's)."""

    def __init__(self) -> None:
        self._pid = -1
        self._slots: threading.BoundedSemaphore | None = None
        self._made = threading.Lock()

    def acquire(self) -> threading.BoundedSemaphore:
        slots = self._slots
        if slots is None or self._pid != os.getpid():
            with self._made:  # one semaphore per process, made once, the pid written last
                if self._slots is None or self._pid != os.getpid():
                    limit = max(1, int(app.conf.broker_pool_limit or 10))
                    self._slots = threading.BoundedSemaphore(limit)
                    self._pid = os.getpid()
                slots = self._slots
        assert slots is not None
        if not slots.acquire(timeout=PUBLISH_WAIT_SECONDS):
            raise PublishBusy(
                f"no broker connection free within {PUBLISH_WAIT_SECONDS:.0f} s: "
                "every one is busy (a broker that does not answer?)"
            )
        return slots


_PUBLISH_SLOTS = _PublishSlots()


def enqueue_batch(
    batch_id: str,
    countdown: float | None = None,
    *,
    scheduled_due_ms: int | None = None,
    rt: Runtime | None = None,
    account_id: str | None = None,
    enqueued_ms: int | None = None,
) -> None:
    """Publish one ``process_account_batch`` message carrying only the batch id (and, for a
    delayed message of :func:`schedule`, the due time of its marker as a keyword argument).

    With ``rt`` and ``account_id``, a message due now first sets the account's ``queued``
    mark (:func:`mark_queued`): the sweeper then knows the account's message is on its way.

    The message's enqueued-at header (which the sweeper reads off the oldest waiting message)
    and the mark carry the Redis server's time: the mark's stamp, or ``enqueued_ms`` (a
    delayed message's, from its schedule), else this host's clock (the mark not written).

    Raises the broker's error when it is unreachable, and :class:`PublishBusy` when every
    broker connection of the process stays busy for ``PUBLISH_WAIT_SECONDS``; callers that
    have persisted the batch already may ignore it, because the sweeper enqueues pending
    batches.
    """
    kwargs: dict[str, Any] = {}
    if scheduled_due_ms is not None:
        kwargs[SCHEDULED_DUE_KWARG] = scheduled_due_ms
    mark = (rt, account_id) if rt is not None and account_id and not countdown else None
    stamp = mark_queued(*mark) if mark is not None else None
    now_ms = stamp or enqueued_ms or int(time.time() * 1000)
    try:
        slots = _PUBLISH_SLOTS.acquire()
        try:
            app.send_task(
                PROCESS_TASK,
                args=[batch_id],
                kwargs=kwargs or None,
                queue=PAYMENTS_QUEUE,
                routing_key=PAYMENTS_QUEUE,
                countdown=countdown,
                headers={
                    ENQUEUED_HEADER: now_ms,
                    **({ACCOUNT_HEADER: account_id} if account_id else {}),
                },
            )
        finally:
            slots.release()
    except Exception:
        if mark is not None:  # nothing is on its way: the sweeper must not wait for it
            unmark_queued(*mark)
        raise


def mark_queued(rt: Runtime, account_id: str) -> int | None:
    """Note that a message for the account is being published (before the publish: a holder
    that takes the account at once deletes the mark after it); its stamp, the Redis server's
    time in ms, or None when Redis did not answer. Best effort: without the mark the sweeper
    may send one repair message too many, never one too few."""
    try:
        # the client with short timeouts: a slow Redis must not hold up a publish
        script = rt.dedup_redis.register_script(_MARK_LUA)
        stamp = script(
            keys=[rt.keys.queued(account_id)], args=[rt.settings.visibility_timeout * 1000]
        )
        return int(stamp)
    except Exception as exc:
        log.warning("queued_mark_failed", account_id=account_id, error=repr(exc))
        return None


def unmark_queued(rt: Runtime, account_id: str) -> None:
    """Drop the account's ``queued`` mark after a failed publish (best effort)."""
    try:
        rt.dedup_redis.delete(rt.keys.queued(account_id))
    except Exception as exc:
        log.warning("queued_mark_failed", account_id=account_id, error=repr(exc))


def hand_off(account_id: str, batch_id: str, rt: Runtime | None = None) -> None:
    """End of a slice: the account goes back to the queue (after the lock is released, so the
    next execution finds it free), and any free worker in any process continues it while
    other accounts get their turn. With ``rt``, the account is marked queued."""
    try:
        enqueue_batch(batch_id, rt=rt, account_id=account_id or None)
    except Exception as exc:
        # broker down: the sweeper re-enqueues stalled accounts
        log.warning("hand_off_failed", account_id=account_id, error=repr(exc))


def schedule(rt: Runtime, account_id: str, batch_id: str, wait: float) -> float:
    """One delayed message per account for work that is not due yet; returns the countdown.

    The account's ``scheduled`` marker holds the due time of the message on its way. A
    message due no later (or less than ``SCHEDULE_EARLIER_BY_MS`` later) makes this one
    unnecessary; a later one is replaced: the marker takes the earlier due time and this
    message is published, so a retry runs after its own backoff, never after a longer one
    scheduled before it (the later message then runs
    anyway, finds nothing due or drains, and leaves the marker alone). The task of a delayed
    message clears the marker when it runs (:func:`clear_schedule`).
    """
    # a countdown must stay below the broker's visibility timeout (or the message would be
    # redelivered while still waiting); if a Retry-After is longer, the task runs early, finds
    # nothing due and schedules again
    wait = min(max(wait, 0.0), rt.settings.visibility_timeout * 0.5)
    marker = rt.keys.scheduled(account_id)
    claim = rt.redis.register_script(_CLAIM_LUA)
    # the marker outlives the due time a little; the sweeper covers a lost delayed message
    created, due = claim(
        keys=[marker],
        # the call's own value: the client's retry after a lost reply is answered as the
        # call was, so the message is still published (else the marker would hold back
        # every retry of the account until it expired and the sweeper came)
        args=[
            int(wait * 1000),
            batch_id,
            SCHEDULE_SLACK_MS,
            SCHEDULE_EARLIER_BY_MS,
            secrets.token_hex(8),
        ],
    )
    if created == 1:
        try:
            enqueue_batch(
                batch_id,
                countdown=wait or None,
                scheduled_due_ms=int(due),
                account_id=account_id,
                # the claim's time on the Redis server's clock
                enqueued_ms=int(due) - int(wait * 1000),
            )
        except Exception as exc:
            clear_schedule(rt, account_id, int(due))
            log.warning("schedule_failed", account_id=account_id, error=repr(exc))
    return wait


def clear_schedule(rt: Runtime, account_id: str, due_ms: int) -> bool:
    """The delayed message due at ``due_ms`` has arrived: clear the account's marker if it
    is still that message's (an earlier one may have replaced it). True when cleared."""
    clear = rt.redis.register_script(_CLEAR_LUA)
    return bool(clear(keys=[rt.keys.scheduled(account_id)], args=[str(due_ms)]) == 1)


class RedisAccountQueue:
    """The drain loop's :class:`~payment_worker.worker.ports.AccountQueue`: marks in Redis,
    messages through the broker."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        # a mark outlives a holder's slice by far: a task that found the lock busy must not
        # have its work forgotten while the holder drains
        self._mark_ms = rt.settings.lock_ttl_ms * 4

    def arrival(self, account_id: str, batch_id: str) -> Arrival:
        """The "work waiting" mark of the account (its holder checks it after releasing),
        and the marks a taker clears with it: the sweeper's and the queued one (a message on
        its way, repair or not, has done its job once a holder has the account; a message
        published after that sets the queued mark again). All in the account's slot."""
        keys = self._rt.keys
        return Arrival(
            keys.waiting(account_id),
            batch_id,
            self._mark_ms,
            (keys.swept(account_id), keys.queued(account_id)),
        )

    def announced(self, account_id: str) -> bool:
        """Whether a task left the mark again; False when Redis cannot be reached (a task
        that left one ended ``contended``: the sweeper sends its account again once stale)."""
        try:
            return bool(self._rt.redis.exists(self._rt.keys.waiting(account_id)))
        except UNREACHABLE as exc:
            log.warning("mark_unread", account_id=account_id, error=str(exc))
            return False

    def hand_off(self, account_id: str, batch_id: str) -> None:
        """See :func:`hand_off`."""
        hand_off(account_id, batch_id, self._rt)

    def schedule(self, account_id: str, batch_id: str, wait: float) -> float:
        """See :func:`schedule`."""
        return schedule(self._rt, account_id, batch_id, wait)
