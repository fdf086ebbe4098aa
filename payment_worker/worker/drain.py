"""One account's batches through the state machine: claim, send or look up, record, repeat.

The account lock makes one holder per account; the holder drains every due item of the
account (not just the batch its message named), so tasks for a busy account need not retry:
they leave a "work waiting" mark and end, and the holder, before it stops, sees the mark and
drains again. Items not yet due (backoff) are waited for briefly under the lock, or handed to
one delayed message per account.

The holder reports progress to its lock at each claim, each request about to leave, each
item and each recorded chunk (and while it waits for a retry under the lock): a holder
that reports nothing for ``LOCK_MAX_STALL_SECONDS`` is blocked somewhere, and its watchdog
lets the lock expire so that another worker takes the account over behind the fence.

The loop (:class:`Drainer`) talks to the database, the lock, the gateway and the queue only
through the interfaces of :mod:`payment_worker.worker.ports`; :func:`drainer_for` wires it
to a process's :class:`~payment_worker.runtime.Runtime`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from structlog.contextvars import bind_contextvars, reset_contextvars

from payment_worker.db.work import Claim, ClaimedItem, account_of_batch
from payment_worker.db.work_store import PgWorkStore
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES, TxStatus
from payment_worker.domain.transitions import ItemOutcome, Policy, handed_back
from payment_worker.errors import DatabaseUnavailable, FencedOut, LockLost
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    BATCH_SECONDS,
    DEAD_LETTERS,
    FENCING_REJECTIONS,
    HANDED_BACK,
    IN_PROGRESS,
    TASK_EXECUTIONS,
    TRANSACTION_RETRIES,
    TRANSACTIONS_FINISHED,
)
from payment_worker.redis_pool import UNREACHABLE
from payment_worker.runtime import Runtime
from payment_worker.worker.item_step import log_outcome, step_item
from payment_worker.worker.ports import AccountQueue, Gateway, Guard, HeldLock, WorkStore
from payment_worker.worker.queueing import RedisAccountQueue, clear_schedule, hand_off
from payment_worker.worker.store_retry import DbRetry, RetryingStore

log = get_logger("processing")

# the pause after a claim that took nothing while something was due: rows another
# transaction holds locked (an operator's session, a retried statement's first try still on
# the server), which the claim skips. Without it the holder claimed in a busy loop
SKIPPED_ROWS_PAUSE = 0.1


@dataclass
class DrainReport:
    """What one task execution did."""

    account_id: str
    # processed | idle | contended | lock_lost | fenced_out | missing | db_unavailable |
    # redis_unavailable
    result: str = "idle"
    items: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    scheduled_in: float | None = None
    handed_off: bool = False
    shutdown: bool = False  # handed back at once because the worker is shutting down


@dataclass(frozen=True, slots=True)
class DrainLimits:
    """How much one holder does before it lets go (from the settings)."""

    chunk_size: int  # PROCESS_CHUNK_SIZE: items claimed, and outcomes written, per statement
    max_seconds: float  # DRAIN_MAX_SECONDS: a slice, then the account goes back to the queue
    hold_wait_max_seconds: float  # HOLD_WAIT_MAX_SECONDS: wait under the lock at most this long


@dataclass(slots=True)
class _ChunkEnd:
    """What the statement that recorded a chunk did besides."""

    # record_and_finish: (batches completed, seconds until the next due item or None)
    finished: tuple[list[str], float | None] | None = None
    # record_and_claim: the next chunk
    claim: Claim | None = None


class Drainer:
    """The drain loop of one process, shared by its worker threads (it holds no state)."""

    def __init__(
        self,
        *,
        open_store: Callable[[], AbstractContextManager[WorkStore]],
        lock_for: Callable[[str], HeldLock],
        gateway: Gateway,
        queue: AccountQueue,
        policy: Policy,
        limits: DrainLimits,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        db_retry: DbRetry | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self._open_store = open_store
        self._lock_for = lock_for
        self._gateway = gateway
        self._queue = queue
        self._policy = policy
        self._limits = limits
        self._clock = clock
        self._sleep = sleep
        # DB_RETRY_MAX_SECONDS: transient database errors cost a retry, not the task
        self._db_retry = db_retry or DbRetry(max_seconds=10.0, clock=clock, sleep=sleep)
        # a warm shutdown began: hand the account back at the next safe point
        self._stopping = stopping

    def run_account(self, account_id: str, batch_id: str) -> DrainReport:
        """Drain the account's due work if its lock is free; otherwise leave a mark and return."""
        # the lock attempt leaves the mark when the lock is busy, and clears the marks when
        # it is taken, in one step: the holder checks the mark after it releases, so work
        # announced here is either seen by the holder or finds the lock free
        arrival = self._queue.arrival(account_id, batch_id)
        report = DrainReport(account_id)
        task_started = self._clock()
        while True:
            lock = self._lock_for(account_id)
            # Redis only: the fencing token is issued by the drain's first claim, in that
            # statement (a token taken here would cost a database round trip of its own);
            # the gateway's token and pacing lease are read in the same round trip
            rider = self._gateway.account_start(account_id)
            acquired = lock.acquire(blocking=False, arrival=arrival, fence=False, rider=rider)
            if not acquired:
                if report.result == "idle":
                    report.result = "contended"
                break
            started = self._clock()
            IN_PROGRESS.inc()
            try:
                # a token the start found needed is asked for now: its answer comes back
                # while the first claim runs (read, and its lock let go, by account_end at
                # the latest)
                self._gateway.prefetch_token(account_id)
                self._drain(lock, batch_id, report)  # everything committed so far
            finally:
                IN_PROGRESS.dec()
                end = None
                try:
                    # what the holder leased and did not use (pacing slots, a token refresh)
                    # goes back in the release's round trip, before the lock goes: whoever
                    # takes the account next finds it given back
                    end = self._gateway.account_end(account_id)
                finally:
                    lock.release(arrival, end)  # and reads the mark, in one round trip
                BATCH_SECONDS.observe(self._clock() - started)
            if report.handed_off:
                self._queue.hand_off(account_id, batch_id)
                if report.shutdown:
                    HANDED_BACK.inc()
                break
            if report.result == "lock_lost":
                # taken over, or our own liveness lapsed: if nobody took the account (the
                # lock was freed above), this message sends it to a live worker at once; if
                # someone did, it costs that holder one contended execution
                self._queue.hand_off(account_id, batch_id)
                break
            if report.result == "fenced_out":
                break
            marked = lock.marked
            if not (self._queue.announced(account_id) if marked is None else marked):
                break
            if self._clock() - task_started >= self._limits.max_seconds:
                # work keeps arriving, each drain ending before the next batch: this task
                # has had its slice. The account goes back to the queue as at a slice's
                # end, so one busy account cannot pin a worker slot (a prefork child)
                self._queue.hand_off(account_id, batch_id)
                report.handed_off = True
                break
        TASK_EXECUTIONS.labels(report.result).inc()
        log.info(
            "account_drained",
            account_id=account_id,
            batch_id=batch_id,
            result=report.result,
            items=report.items,
            finished=report.finished,
            scheduled_in=report.scheduled_in,
        )
        return report

    def _drain(self, lock: HeldLock, batch_id: str, report: DrainReport) -> None:
        limits = self._limits
        account_id = report.account_id
        # None until the first claim issues it (the lock was taken with fence=False)
        token = lock.fence_token
        deadline = self._clock() + limits.max_seconds
        with self._open_store() as opened:
            store = RetryingStore(opened, lock, self._db_retry, account_id)
            # the next chunk, when the last boundary's statement claimed it
            items: Claim | None = None
            # the last batch of the chunk before, not yet known to have ended: its items may
            # have ended exactly with that chunk
            carried: int | None = None
            try:
                while True:
                    if not items:
                        # (a chunk the boundary claimed is checked by its first item's guard,
                        # which gives the chunk back untouched if the lock went meanwhile)
                        lock.ensure_held()
                    if items is None:
                        if self._stopping():
                            report.handed_off = report.shutdown = True
                            return
                        if token is None:
                            items = store.fence_and_claim(account_id, limits.chunk_size)
                            assert items.fence_token is not None
                            token = items.fence_token
                            lock.adopt_fence(token)
                        else:
                            items = store.claim_due(account_id, token, limits.chunk_size)
                    # (a chunk claimed at the boundary is not checked for a shutdown here:
                    # its items are, one by one, and given back untouched)
                    assert token is not None  # issued by the first claim
                    lock.progress()
                    if items.more_due:
                        # more was due than one chunk. Items are claimed in batch order,
                        # so a batch followed by another in it has nothing more to claim;
                        # the chunk's last batch is checked with the next chunk (if that one
                        # does not go on with it, its items ended exactly with this chunk)
                        batches = {i.batch_pk for i in items}
                        if carried is not None:
                            batches.add(carried)
                        carried = items[-1].batch_pk
                        ended = sorted(batches - {carried})
                        # recorded with those batches completed and the next chunk claimed,
                        # in one statement, unless the slice ends here
                        chunk = self._process_chunk(
                            store, lock, token, items, report, ended=ended, until=deadline
                        )
                        items = chunk.claim
                        if items is not None:
                            continue
                        if self._clock() < deadline and not self._stopping():
                            if ended:
                                store.complete_batches(account_id, token, ended)
                            continue
                        # the slice ends: no next chunk checks the last batch, so this does
                        store.complete_batches(account_id, token, sorted(batches))
                        # run_account re-enqueues after releasing
                        report.handed_off = True
                        report.shutdown = self._stopping()
                        return
                    # the chunk took everything due at the claim: no second claim. Its
                    # outcomes, the account's finished batches and its next due time are one
                    # statement (or, for a chunk cut short or nothing claimed, the last two)
                    finished = (
                        self._process_chunk(store, lock, token, items, report, finish=True).finished
                        if items
                        else None
                    )
                    claimed_nothing = not items
                    items = carried = None  # (the finish completes every batch it can)
                    if finished is None:
                        finished = store.complete_and_next_due(account_id, token)
                    _, wait = finished
                    if wait is None:
                        return
                    if claimed_nothing and wait <= 0:
                        wait = SKIPPED_ROWS_PAUSE
                    if self._stopping() or (wait <= 0 and self._clock() >= deadline):
                        # work due now (new since the claim) and the slice is over: the next
                        # slice takes it; work not due yet is scheduled below
                        report.handed_off = True
                        report.shutdown = self._stopping()
                        return
                    if wait <= limits.hold_wait_max_seconds and self._clock() + wait < deadline:
                        self._sleep_holding(lock, wait)
                        continue
                    report.scheduled_in = self._queue.schedule(account_id, batch_id, wait)
                    return
            except LockLost as exc:
                report.result = "lock_lost"
                log.warning(
                    "drain_stopped_lock_lost",
                    account_id=account_id,
                    fence_token=token,
                    reason=str(exc),
                )
            except FencedOut as exc:
                # counted here, once: the data layer only raises
                FENCING_REJECTIONS.inc()
                report.result = "fenced_out"
                log.warning("fenced_out", account_id=account_id, fence_token=token, reason=str(exc))
            except DatabaseUnavailable as exc:
                # past DB_RETRY_MAX_SECONDS: run_account releases and re-enqueues; what was
                # claimed and not recorded is looked up by the next holder
                report.result = "db_unavailable"
                report.handed_off = True
                log.warning("db_unavailable", account_id=account_id, reason=str(exc))

    def _sleep_holding(self, lock: HeldLock, seconds: float) -> None:
        end = self._clock() + max(seconds, 0.0)
        while True:
            lock.ensure_held()
            lock.progress()  # waiting on purpose, for a bounded time, is not a stall
            left = end - self._clock()
            if left <= 0 or self._stopping():
                return
            self._sleep(min(left, 0.1))

    def _process_chunk(
        self,
        store: WorkStore,
        lock: HeldLock,
        token: int,
        items: list[ClaimedItem],
        report: DrainReport,
        *,
        finish: bool = False,
        ended: Sequence[int] = (),
        until: float | None = None,
    ) -> _ChunkEnd:
        """Process one claimed chunk and record what was learnt, in one statement with what
        comes next where it can be: with ``finish`` (the drain's last chunk), the account's
        completion and next due time (:attr:`_ChunkEnd.finished`); with ``until`` (more is
        due), the batches that ``ended`` in the chunk completed and the next chunk claimed
        (:attr:`_ChunkEnd.claim`), unless the slice is over at ``until``, the worker is
        stopping or the lock is gone. A chunk cut short is only recorded."""
        outcomes: list[ItemOutcome] = []
        given_back: list[ItemOutcome] = []
        end = _ChunkEnd()
        ran_to_end = False
        # whether a request for the item being stepped passed its guard (may have left)
        passed = [False]
        guard = _progress_guard(lock, passed)
        lost = False
        try:
            for index, item in enumerate(items):
                if self._stopping():
                    # a safe point (between items): the outcomes so far are recorded below
                    # and the rest is given back untouched, due now, so the next holder
                    # sends them without a lookup
                    given_back = [_untouched(i) for i in items[index:]]
                    break
                # one bind per item (about 3 µs): every line about it names it
                bound = bind_contextvars(
                    transaction_id=item.transaction_id, attempt=item.attempts, fence_token=token
                )
                passed[0] = False
                try:
                    outcome = step_item(self._gateway, self._policy, guard, item)
                    log_outcome(outcome.decision)
                except LockLost:
                    # the lock went before one of this item's requests could leave: the items
                    # after it were never tried, nor this one if none of its requests passed
                    # the guard. They are given back untouched (the write is fenced: it lands
                    # only while no newer holder exists), so the next holder sends them
                    # without a lookup and their claimed attempts are not spent
                    given_back = [_untouched(i) for i in items[index + passed[0] :]]
                    lost = True
                    raise
                finally:
                    reset_contextvars(**bound)
                outcomes.append(outcome)
                lock.progress()
            else:
                ran_to_end = True
        finally:
            # what was learnt is written even when the lock was lost mid-chunk: the write is
            # fenced, so it lands only if no newer holder exists; items left "dispatching" are
            # looked up by the next holder before any resend
            if outcomes or given_back:
                account_id = report.account_id
                if finish and ran_to_end:
                    _, done, wait = store.record_and_finish(account_id, token, outcomes)
                    end.finished = (done, wait)
                elif ran_to_end and until is not None and self._may_go_on(lock, until):
                    _, _, end.claim = store.record_and_claim(
                        account_id, token, outcomes, ended, self._limits.chunk_size
                    )
                elif lost and not outcomes:
                    # only items never tried, after a lost lock: a newer holder may have them
                    # already, and then this fenced write is refused as it should be. Not a
                    # rejection to count or report: the lock loss is
                    with contextlib.suppress(FencedOut):
                        store.record_outcomes(account_id, token, given_back)
                else:
                    store.record_outcomes(account_id, token, outcomes + given_back)
                lock.progress()
                report.items += len(outcomes)
                report.result = "processed"
                for d in (o.decision for o in outcomes):
                    if d.status in TERMINAL_TX_STATUSES:
                        report.finished[d.status] = report.finished.get(d.status, 0) + 1
                        TRANSACTIONS_FINISHED.labels(d.status).inc()
                        if d.dead_reason:
                            DEAD_LETTERS.labels(d.dead_reason).inc()
                    else:
                        TRANSACTION_RETRIES.labels(d.status).inc()
        return end

    def _may_go_on(self, lock: HeldLock, until: float) -> bool:
        """Whether the holder claims its next chunk now: its slice is not over, the worker
        is not stopping and the lock is still its own (checked without raising: the chunk's
        outcomes are recorded either way)."""
        if self._clock() >= until or self._stopping():
            return False
        try:
            lock.ensure_held()
        except LockLost:
            return False
        return True


def _untouched(item: ClaimedItem) -> ItemOutcome:
    """A claimed item given back untouched (at a shutdown, or a lock lost before any of its
    requests left): its claimed attempt is given back too."""
    attempts = item.attempts - (item.status is TxStatus.DISPATCHING)
    return ItemOutcome(item.id, attempts, item.lookups, handed_back(item.status))


def _progress_guard(lock: HeldLock, passed: list[bool]) -> Guard:
    """The check before each send: the lock must still be ours; a request about to leave
    is progress (a holder only waiting on the gateway's pacing or token is never stalled).
    ``passed[0]`` is set once a request passed it."""

    def guard() -> None:
        lock.ensure_held()
        passed[0] = True
        lock.progress()

    return guard


def drainer_for(rt: Runtime) -> Drainer:
    """The drain loop on a process's runtime: Postgres, the Redis lock, the gateway client."""
    s = rt.settings
    return Drainer(
        open_store=lambda: PgWorkStore.open(rt.autocommit_engine),
        lock_for=rt.account_lock,
        gateway=rt.gateway,
        queue=RedisAccountQueue(rt),
        policy=rt.policy,
        limits=DrainLimits(
            chunk_size=s.process_chunk_size,
            max_seconds=s.drain_max_seconds,
            hold_wait_max_seconds=s.hold_wait_max_seconds,
        ),
        db_retry=DbRetry(max_seconds=s.db_retry_max_seconds),
        stopping=rt.shutting_down.is_set,
    )


def run_account(account_id: str, batch_id: str, rt: Runtime) -> DrainReport:
    """Drain one account on the process's runtime (see :meth:`Drainer.run_account`)."""
    return drainer_for(rt).run_account(account_id, batch_id)


def run_batch_task(
    batch_id: str,
    rt: Runtime,
    *,
    scheduled_due_ms: int | None = None,
    account_id: str | None = None,
) -> DrainReport:
    """The body of the ``process_account_batch`` task; ``scheduled_due_ms``: the message is
    the account's delayed one (:func:`~payment_worker.worker.queueing.schedule`);
    ``account_id``: the batch's account as the publisher gave it (else it is looked up)."""
    try:
        if account_id is None:
            account_id = DbRetry(max_seconds=rt.settings.db_retry_max_seconds).call(
                "account_of_batch", lambda: _account_of(rt, batch_id), account_id=""
            )
    except DatabaseUnavailable as exc:
        # the message is all this task has: put it back rather than fail (a crash record)
        log.warning("db_unavailable", batch_id=batch_id, reason=str(exc))
        TASK_EXECUTIONS.labels("db_unavailable").inc()
        hand_off("", batch_id)
        return DrainReport(account_id="", result="db_unavailable")
    if account_id is None:
        log.warning("batch_missing", batch_id=batch_id)
        TASK_EXECUTIONS.labels("missing").inc()
        return DrainReport(account_id="", result="missing")
    # every line of this run names the account; restored after, so a caller's context is
    # left as it was (a task's is cleared at task_postrun anyway)
    bound = bind_contextvars(account_id=account_id)
    try:
        if scheduled_due_ms is not None:
            # before draining: what this drain (or the holder it marks) schedules next must
            # find no marker of a message that has already arrived
            clear_schedule(rt, account_id, scheduled_due_ms)
        return run_account(account_id, batch_id, rt)
    except UNREACHABLE as exc:
        # Redis (locks, liveness, pacing, marks) could not be reached: nothing is wrong with
        # the batch, so no crash record for on-call. Postgres keeps every item where it was
        # (one whose send may have left stays dispatching, looked up before any resend); a
        # lock this task took or held is given back by the process's give-back thread; the
        # sweeper sends the account again once Redis answers and the account is stale.
        log.warning("redis_unavailable", batch_id=batch_id, error=str(exc))
        TASK_EXECUTIONS.labels("redis_unavailable").inc()
        return DrainReport(account_id=account_id, result="redis_unavailable")
    finally:
        reset_contextvars(**bound)


def _account_of(rt: Runtime, batch_id: str) -> str | None:
    with rt.autocommit_engine.connect() as conn:
        return account_of_batch(conn, batch_id)
