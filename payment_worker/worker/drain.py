"""One account's batches through the state machine: claim, send or look up, record, repeat.

The account lock makes one holder per account; the holder drains every due item of the
account (not just the batch its message named), so tasks for a busy account need not retry:
they leave a "work waiting" mark and end, and the holder, before it stops, sees the mark and
drains again. Items not yet due (backoff) are waited for briefly under the lock, or handed to
one delayed message per account.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import redis
from sqlalchemy import Connection, Engine

from payment_worker.db import work as repo
from payment_worker.db.engine import get_engine
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.retry import Backoff
from payment_worker.domain.transitions import (
    FINGERPRINT_MISMATCH,
    TERMINAL,
    Decision,
    Policy,
    after_lookup,
    after_send,
)
from payment_worker.errors import FencedOut, LockLost
from payment_worker.gateway.client import GatewayClient
from payment_worker.locks.account_lock import AccountLock
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    BATCH_SECONDS,
    DEAD_LETTERS,
    IN_PROGRESS,
    LOOKUPS,
    TASK_EXECUTIONS,
    TRANSACTION_RETRIES,
    TRANSACTIONS_FINISHED,
)
from payment_worker.redis_keys import RedisKeys
from payment_worker.services import redis_url
from payment_worker.settings import Settings, get_settings

log = get_logger("processing")


@dataclass
class Resources:
    """The per-process clients the processing loop shares between threads."""

    settings: Settings
    engine: Engine
    redis: redis.Redis
    gateway: GatewayClient

    @property
    def policy(self) -> Policy:
        """Retry limits and timing from the settings."""
        s = self.settings
        return Policy(
            max_attempts=s.retry_max_attempts,
            max_lookups=s.lookup_max_attempts,
            backoff=Backoff(base=s.retry_base_delay, cap=s.retry_max_delay),
        )

    @property
    def keys(self) -> RedisKeys:
        """The Redis key names under the configured ``REDIS_KEY_PREFIX``."""
        return RedisKeys(self.settings.redis_key_prefix)


_res_lock = threading.Lock()
_resources: dict[int, Resources] = {}


def resources() -> Resources:
    """This process's clients, created on first use (a forked child gets its own)."""
    pid = os.getpid()
    res = _resources.get(pid)
    if res is None:
        with _res_lock:
            res = _resources.get(pid)
            if res is None:
                s = get_settings()
                r = redis.Redis.from_url(redis_url(s), health_check_interval=10)
                res = Resources(s, get_engine(s), r, GatewayClient(s, r))
                _resources.clear()
                _resources[pid] = res
    return res


def reset_resources() -> None:
    """Forget this process's clients (tests, or after settings change)."""
    with _res_lock:
        for res in _resources.values():
            res.gateway.close()
        _resources.clear()


@dataclass
class DrainReport:
    """What one task execution did."""

    account_id: str
    result: str = "idle"  # processed | idle | contended | lock_lost | fenced_out | missing
    items: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    scheduled_in: float | None = None
    handed_off: bool = False


def run_batch_task(batch_id: str) -> DrainReport:
    """The body of the ``process_account_batch`` task."""
    res = resources()
    with res.engine.connect() as conn:
        account_id = repo.account_of_batch(conn, batch_id)
    if account_id is None:
        log.warning("batch_missing", batch_id=batch_id)
        TASK_EXECUTIONS.labels("missing").inc()
        return DrainReport(account_id="", result="missing")
    return run_account(account_id, batch_id, res)


def run_account(account_id: str, batch_id: str, res: Resources | None = None) -> DrainReport:
    """Drain the account's due work if its lock is free; otherwise leave a mark and return."""
    res = res or resources()
    waiting = res.keys.waiting(account_id)
    # mark before trying the lock: the holder checks the mark after it releases, so work
    # announced here is either seen by the holder or finds the lock free
    res.redis.set(waiting, batch_id, px=res.settings.lock_ttl_ms * 4)
    report = DrainReport(account_id)
    while True:
        lock = AccountLock(res.redis, account_id, engine=res.engine)
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
            _hand_off(res, account_id, batch_id)
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


def _drain(res: Resources, lock: AccountLock, batch_id: str, report: DrainReport) -> None:
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
                _schedule(res, account_id, batch_id, wait, report)
                return
        except LockLost as exc:
            report.result = "lock_lost"
            log.warning("lock_lost", account_id=account_id, reason=str(exc))
        except FencedOut as exc:
            report.result = "fenced_out"
            log.warning("fenced_out", account_id=account_id, reason=str(exc))


def _hand_off(res: Resources, account_id: str, batch_id: str) -> None:
    """End of a slice: the account goes back to the queue (after the lock is released, so the
    next execution finds it free), and any free worker in any process continues it while
    other accounts get their turn."""
    from payment_worker.worker.tasks import enqueue_batch

    try:
        enqueue_batch(batch_id)
    except Exception as exc:
        # broker down: the sweeper re-enqueues stalled accounts
        log.warning("hand_off_failed", account_id=account_id, error=repr(exc))


def _sleep_holding(lock: AccountLock, seconds: float) -> None:
    end = time.monotonic() + max(seconds, 0.0)
    while True:
        lock.ensure_held()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.1))


def _schedule(
    res: Resources, account_id: str, batch_id: str, wait: float, report: DrainReport
) -> None:
    """One delayed message per account for work that is not due yet."""
    from payment_worker.worker.tasks import enqueue_batch

    # a countdown must stay below the broker's visibility timeout (or the message would be
    # redelivered while still waiting); if a Retry-After is longer, the task runs early, finds
    # nothing due and schedules again
    wait = min(max(wait, 0.0), res.settings.visibility_timeout * 0.5)
    report.scheduled_in = wait
    marker = res.keys.scheduled(account_id)
    # the marker outlives the countdown a little; the sweeper covers a lost delayed message
    if res.redis.set(marker, batch_id, nx=True, px=int((wait + 5.0) * 1000)):
        try:
            enqueue_batch(batch_id, countdown=wait or None)
        except Exception as exc:
            res.redis.delete(marker)
            log.warning("schedule_failed", account_id=account_id, error=repr(exc))


def _process_chunk(
    res: Resources,
    conn: Connection,
    lock: AccountLock,
    token: int,
    items: list[repo.ClaimedItem],
    report: DrainReport,
) -> None:
    outcomes: list[repo.Outcome] = []
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
            for o in outcomes:
                if o.status in TERMINAL:
                    report.finished[o.status] = report.finished.get(o.status, 0) + 1
                    TRANSACTIONS_FINISHED.labels(o.status).inc()
                    if o.dead_reason:
                        DEAD_LETTERS.labels(o.dead_reason).inc()
                else:
                    TRANSACTION_RETRIES.labels(o.status).inc()


def _outcome(item: repo.ClaimedItem, d: Decision, attempts: int, lookups: int) -> repo.Outcome:
    return repo.Outcome(
        id=item.id,
        status=d.status,
        attempts=attempts,
        lookups=lookups,
        delay=d.delay,
        payment_id=d.payment_id,
        error_class=d.error_class,
        error=d.error,
        key_status=d.key_status,
        dead_reason=d.dead_reason,
    )


def _process_item(res: Resources, lock: AccountLock, item: repo.ClaimedItem) -> repo.Outcome:
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
            "dead",
            error_class="fingerprint_mismatch",
            error="request body differs from the accepted one",
            dead_reason=FINGERPRINT_MISMATCH,
        )
        return _outcome(item, d, attempts, lookups)
    policy = res.policy
    # ensure_held() runs inside the client right before each send (after any pacing wait)
    if item.status == "unknown":
        found = res.gateway.lookup_payment(
            item.account_id, item.idempotency_key, guard=lock.ensure_held
        )
        lookups += 1
        LOOKUPS.labels(found.outcome.value).inc()
        d = after_lookup(found, attempts=attempts, lookups=lookups, policy=policy)
        if not d.send_now:
            return _outcome(item, d, attempts, lookups)
        attempts += 1  # never applied: send again under the same key
    result = res.gateway.create_payment(
        item.account_id, request, item.idempotency_key, guard=lock.ensure_held
    )
    d = after_send(result, attempts=attempts, lookups=lookups, policy=policy)
    return _outcome(item, d, attempts, lookups)
