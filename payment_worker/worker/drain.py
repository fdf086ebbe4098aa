"""One account's batches through the state machine: claim, send or look up, record, repeat.

The account lock makes one holder per account; the holder drains every due item of the
account (not just the batch its message named), so tasks for a busy account need not retry:
they leave a "work waiting" mark and end, and the holder, before it stops, sees the mark and
drains again. Items not yet due (backoff) are waited for briefly under the lock, or handed to
one delayed message per account.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy import Connection

from payment_worker.db import work as repo
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES, DeadReason, TxStatus
from payment_worker.domain.transitions import (
    Decision,
    ItemOutcome,
    after_lookup,
    after_send,
)
from payment_worker.errors import FencedOut, LockLost
from payment_worker.locks.account_lock import AccountLock
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    BATCH_SECONDS,
    DEAD_LETTERS,
    FENCING_REJECTIONS,
    IN_PROGRESS,
    LOOKUPS,
    TASK_EXECUTIONS,
    TRANSACTION_RETRIES,
    TRANSACTIONS_FINISHED,
)
from payment_worker.runtime import Runtime
from payment_worker.worker import queueing

log = get_logger("processing")


@dataclass
class DrainReport:
    """What one task execution did."""

    account_id: str
    result: str = "idle"  # processed | idle | contended | lock_lost | fenced_out | missing
    items: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    scheduled_in: float | None = None
    handed_off: bool = False


def run_batch_task(batch_id: str, res: Runtime) -> DrainReport:
    """The body of the ``process_account_batch`` task."""
    with res.engine.connect() as conn:
        account_id = repo.account_of_batch(conn, batch_id)
    if account_id is None:
        log.warning("batch_missing", batch_id=batch_id)
        TASK_EXECUTIONS.labels("missing").inc()
        return DrainReport(account_id="", result="missing")
    return run_account(account_id, batch_id, res)


def run_account(account_id: str, batch_id: str, res: Runtime) -> DrainReport:
    """Drain the account's due work if its lock is free; otherwise leave a mark and return."""
    waiting = res.keys.waiting(account_id)
    # mark before trying the lock: the holder checks the mark after it releases, so work
    # announced here is either seen by the holder or finds the lock free
    res.redis.set(waiting, batch_id, px=res.settings.lock_ttl_ms * 4)
    report = DrainReport(account_id)
    while True:
        lock = res.account_lock(account_id)
        if not lock.acquire(blocking=False):
            if report.result == "idle":
                report.result = "contended"
            break
        started = time.monotonic()
        IN_PROGRESS.inc()
        try:
            res.redis.delete(waiting)  # consumed: everything committed so far is drained below
            _drain(res, lock, batch_id, report)
        finally:
            IN_PROGRESS.dec()
            lock.release()
            BATCH_SECONDS.observe(time.monotonic() - started)
        if report.handed_off:
            queueing.hand_off(account_id, batch_id)
            break
        if report.result in ("lock_lost", "fenced_out"):
            break
        if not res.redis.exists(waiting):
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


def _drain(res: Runtime, lock: AccountLock, batch_id: str, report: DrainReport) -> None:
    s = res.settings
    account_id = report.account_id
    token = lock.fence_token
    assert token is not None
    deadline = time.monotonic() + s.drain_max_seconds
    with res.engine.connect() as base:
        # autocommit: each statement is its own short transaction; none spans an HTTP call
        conn = base.execution_options(isolation_level="AUTOCOMMIT")
        try:
            while True:
                lock.ensure_held()
                items = repo.claim_due(conn, account_id, token, s.process_chunk_size)
                if items:
                    _process_chunk(res, conn, lock, token, items, report)
                    # items are claimed in batch order: a batch followed by another in this
                    # chunk, or ending a short chunk, has nothing more to claim now
                    done = {i.batch_pk for i in items}
                    if len(items) == s.process_chunk_size:
                        done.discard(items[-1].batch_pk)
                    if done:
                        repo.complete_batches(conn, account_id, token, sorted(done))
                    if time.monotonic() < deadline:
                        continue
                    report.handed_off = True  # run_account re-enqueues after releasing
                    return
                repo.complete_batches(conn, account_id, token)
                wait = repo.seconds_until_next_due(conn, account_id)
                if wait is None:
                    return
                if wait <= s.hold_wait_max_seconds and time.monotonic() + wait < deadline:
                    _sleep_holding(lock, wait)
                    continue
                report.scheduled_in = queueing.schedule(res, account_id, batch_id, wait)
                return
        except LockLost as exc:
            report.result = "lock_lost"
            log.warning("lock_lost", account_id=account_id, reason=str(exc))
        except FencedOut as exc:
            # counted here, once: the data layer only raises
            FENCING_REJECTIONS.inc()
            report.result = "fenced_out"
            log.warning("fenced_out", account_id=account_id, reason=str(exc))


def _sleep_holding(lock: AccountLock, seconds: float) -> None:
    end = time.monotonic() + max(seconds, 0.0)
    while True:
        lock.ensure_held()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.1))


def _process_chunk(
    res: Runtime,
    conn: Connection,
    lock: AccountLock,
    token: int,
    items: list[repo.ClaimedItem],
    report: DrainReport,
) -> None:
    outcomes: list[ItemOutcome] = []
    try:
        for item in items:
            outcomes.append(_process_item(res, lock, item))
    finally:
        # what was learnt is written even when the lock was lost mid-chunk: the write is
        # fenced, so it lands only if no newer holder exists; items left "dispatching" are
        # looked up by the next holder before any resend
        if outcomes:
            repo.record_outcomes(conn, report.account_id, token, outcomes)
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


def _process_item(res: Runtime, lock: AccountLock, item: repo.ClaimedItem) -> ItemOutcome:
    request = PaymentRequest(
        account_id=item.account_id,
        transaction_id=item.transaction_id,
        amount=item.amount,
        currency=item.currency,
        beneficiary=item.beneficiary,
        description=item.description,
    )
    attempts, lookups = item.attempts, item.lookups
    if item.request_fingerprint is not None and request.fingerprint() != item.request_fingerprint:
        # the row no longer matches what was accepted: never send a different body under the key
        d = Decision(
            TxStatus.DEAD,
            error_class="fingerprint_mismatch",
            error="request body differs from the accepted one",
            dead_reason=DeadReason.FINGERPRINT_MISMATCH,
        )
        return ItemOutcome(item.id, attempts, lookups, d)
    policy = res.policy
    # ensure_held() runs inside the client right before each send (after any pacing wait)
    if item.status is TxStatus.UNKNOWN:
        found = res.gateway.lookup_payment(
            item.account_id, item.idempotency_key, guard=lock.ensure_held
        )
        lookups += 1
        LOOKUPS.labels(found.outcome.value).inc()
        d = after_lookup(found, attempts=attempts, lookups=lookups, policy=policy)
        if not d.send_now:
            return ItemOutcome(item.id, attempts, lookups, d)
        attempts += 1  # never applied: send again under the same key
    result = res.gateway.create_payment(
        item.account_id, request, item.idempotency_key, guard=lock.ensure_held
    )
    d = after_send(result, attempts=attempts, lookups=lookups, policy=policy)
    return ItemOutcome(item.id, attempts, lookups, d)
