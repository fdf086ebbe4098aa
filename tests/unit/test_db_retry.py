"""Transient database errors: the classification (db/retry.py) and the drain's bounded retry
(worker/store_retry.py) on the fakes of tests/fakes.py, with real SQLAlchemy/psycopg errors."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import errors as pg_errors
from sqlalchemy import exc as sa_exc

from payment_worker.db.retry import REASONS, is_transient, transient_reason
from payment_worker.db.work import ClaimedItem
from payment_worker.domain.retry import Backoff
from payment_worker.domain.statuses import TxStatus
from payment_worker.domain.transitions import ItemOutcome, Policy
from payment_worker.errors import DatabaseUnavailable
from payment_worker.worker.drain import Drainer, DrainLimits
from payment_worker.worker.store_retry import DbRetry
from tests.fakes import FakeClock, FakeGateway, FakeLock, FakeQueue, FakeStore

ACCT = "acct-1"


def dbapi(orig: BaseException, *, invalidated: bool = False) -> sa_exc.DBAPIError:
    """The error SQLAlchemy raises around a driver error (``OperationalError`` and friends)."""
    return sa_exc.DBAPIError.instance(
        "SELECT 1", {}, orig, psycopg.Error, connection_invalidated=invalidated
    )


ADMIN_SHUTDOWN = dbapi(pg_errors.AdminShutdown("terminating connection due to administrator"))


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ADMIN_SHUTDOWN, "admin_shutdown"),
        (
            dbapi(pg_errors.CannotConnectNow("the database system is starting up")),
            "cannot_connect_now",
        ),
        (dbapi(pg_errors.SerializationFailure("could not serialize")), "serialization_failure"),
        (dbapi(pg_errors.DeadlockDetected("deadlock detected")), "deadlock"),
        (dbapi(pg_errors.ReadOnlySqlTransaction("read-only transaction")), "read_only"),
        (
            dbapi(psycopg.OperationalError("server closed the connection unexpectedly")),
            "connection",
        ),
        (dbapi(psycopg.OperationalError("connection refused")), "connection"),
        (dbapi(psycopg.DatabaseError("ssl error"), invalidated=True), "disconnect"),
        (sa_exc.TimeoutError("QueuePool limit of size 2 overflow 0 reached"), "pool_timeout"),
        # a prepared statement refused after a migration changed a column it returns
        (
            dbapi(pg_errors.FeatureNotSupported("cached plan must not change result type")),
            "plan_changed",
        ),
        (dbapi(pg_errors.FeatureNotSupported("LIMIT is not supported here")), None),
        # the bounds that stop a blocked holder on purpose are never retried
        (dbapi(pg_errors.QueryCanceled("canceling statement due to statement timeout")), None),
        (dbapi(pg_errors.LockNotAvailable("canceling statement due to lock timeout")), None),
        (dbapi(pg_errors.UniqueViolation("duplicate key")), None),
        (dbapi(pg_errors.UndefinedTable("no such table")), None),
        (ValueError("not a database error"), None),
    ],
)
def test_what_is_transient(error: BaseException, reason: str | None) -> None:
    assert transient_reason(error) == reason
    assert is_transient(error) is (reason is not None)
    assert reason is None or reason in REASONS


def test_the_metric_knows_every_reason() -> None:
    from payment_worker.ops.metrics import DB_RETRY_REASONS

    assert set(DB_RETRY_REASONS) == set(REASONS)


def _retries(reason: str) -> float:
    return REGISTRY.get_sample_value("payment_worker_db_retries_total", {"reason": reason}) or 0.0


def test_a_call_is_retried_with_growing_jittered_waits_then_succeeds() -> None:
    clock = FakeClock()
    retry = DbRetry(max_seconds=15.0, clock=clock, sleep=clock.sleep, rng=random.Random(1))
    failures = [ADMIN_SHUTDOWN] * 4
    waits: list[float] = []
    checks: list[float] = []

    def fn() -> str:
        if failures:
            raise failures.pop()
        return "ok"

    before = _retries("admin_shutdown")
    start = clock()
    assert (
        retry.call("claim_due", fn, account_id=ACCT, between_tries=lambda: checks.append(clock()))
        == "ok"
    )
    assert _retries("admin_shutdown") == before + 4
    assert len(checks) == 4  # the lock checked (and progress reported) before each new try
    waits = [b - a for a, b in zip([start, *checks], checks, strict=False)]
    for n, w in enumerate(waits, start=1):
        ceiling = Backoff(0.05, 1.0).ceiling(n)
        assert ceiling / 2 <= w <= ceiling  # never zero, never above the cap


def test_past_the_bound_the_call_gives_up_with_database_unavailable() -> None:
    clock = FakeClock()
    retry = DbRetry(max_seconds=3.0, clock=clock, sleep=clock.sleep)
    tries: list[float] = []

    def fn() -> None:
        tries.append(clock())
        raise ADMIN_SHUTDOWN

    with pytest.raises(DatabaseUnavailable, match="admin_shutdown"):
        retry.call("record_outcomes", fn, account_id=ACCT)
    assert tries[-1] - tries[0] <= 3.0  # no try starts past the bound
    assert len(tries) > 3


def test_a_permanent_error_is_raised_at_once() -> None:
    clock = FakeClock()
    retry = DbRetry(max_seconds=15.0, clock=clock, sleep=clock.sleep)
    tries = []

    def fn() -> None:
        tries.append(1)
        raise dbapi(pg_errors.QueryCanceled("statement timeout"))

    with pytest.raises(sa_exc.DBAPIError):
        retry.call("claim_due", fn, account_id=ACCT)
    assert tries == [1]


class FlakyStore(FakeStore):
    """A FakeStore whose calls fail on demand: before the statement ran, or after it
    committed (the answer lost on the way back)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.plan: dict[str, list[tuple[str, BaseException]]] = {}

    def fail(self, method: str, *steps: tuple[str, BaseException]) -> None:
        self.plan.setdefault(method, []).extend(steps)

    def _run(self, method: str, fn: Callable[[], Any]) -> Any:
        steps = self.plan.get(method)
        if steps:
            when, exc = steps.pop(0)
            if when == "after":
                fn()  # committed; the answer never arrives
            raise exc
        return fn()

    def claim_due(self, account_id: str, token: int, limit: int) -> list[ClaimedItem]:
        return self._run(
            "claim_due", lambda: super(FlakyStore, self).claim_due(account_id, token, limit)
        )  # type: ignore[no-any-return]

    def fence_and_claim(self, account_id: str, limit: int) -> list[ClaimedItem]:
        return self._run(
            "fence_and_claim",
            lambda: super(FlakyStore, self).fence_and_claim(account_id, limit),
        )  # type: ignore[no-any-return]

    def record_outcomes(self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]) -> int:
        return self._run(
            "record_outcomes",
            lambda: super(FlakyStore, self).record_outcomes(account_id, token, outcomes),
        )  # type: ignore[no-any-return]


def _drainer(
    store: FakeStore,
    clock: FakeClock,
    gateway: FakeGateway,
    queue: FakeQueue,
    holders: dict[str, FakeLock],
    max_seconds: float = 15.0,
) -> Drainer:
    return Drainer(
        open_store=store.open,
        lock_for=lambda a: FakeLock(a, store, holders),
        gateway=gateway,
        queue=queue,
        policy=Policy(
            max_attempts=3,
            backoff=Backoff(base=1.0, cap=4.0),
            lookup_backoff=Backoff(base=1.0, cap=4.0),
            retry_after_max=300.0,
            in_doubt_max=3600.0,
            key_trust=77760.0,
        ),
        limits=DrainLimits(5, 60.0, 5.0),
        clock=clock,
        sleep=clock.sleep,
        db_retry=DbRetry(max_seconds=max_seconds, clock=clock, sleep=clock.sleep),
    )


def test_a_claim_committed_but_unanswered_is_looked_up_not_sent_twice() -> None:
    clock = FakeClock()
    store, gateway, queue, holders = FlakyStore(clock), FakeGateway(), FakeQueue(), {}
    rows = store.add(ACCT, 1, 3)
    # the drain's first claim, which also issued its fencing token: the retry issues another
    store.fail("fence_and_claim", ("after", ADMIN_SHUTDOWN))
    report = _drainer(store, clock, gateway, queue, holders).run_account(ACCT, "batch-1")
    assert report.result == "processed", report
    assert store.statuses() == {"succeeded": 3}
    assert all(gateway.sends(r.key) == 1 for r in rows)
    assert all(r.lookups == 1 for r in rows)  # each looked up before its one send
    assert holders == {} and queue.handed_off == []


def test_a_record_committed_but_unanswered_is_written_again_harmlessly() -> None:
    clock = FakeClock()
    store, gateway, queue, holders = FlakyStore(clock), FakeGateway(), FakeQueue(), {}
    rows = store.add(ACCT, 1, 4)
    store.fail("record_outcomes", ("after", ADMIN_SHUTDOWN), ("before", ADMIN_SHUTDOWN))
    report = _drainer(store, clock, gateway, queue, holders).run_account(ACCT, "batch-1")
    assert report.result == "processed" and report.items == 4
    assert store.statuses() == {"succeeded": 4}
    assert all(gateway.sends(r.key) == 1 for r in rows)
    assert store.completed == [1]


def test_past_the_bound_the_account_is_released_and_handed_back() -> None:
    clock = FakeClock()
    store, gateway, queue, holders = FlakyStore(clock), FakeGateway(), FakeQueue(), {}
    rows = store.add(ACCT, 1, 3)
    store.fail("record_outcomes", *[("before", ADMIN_SHUTDOWN)] * 1000)
    report = _drainer(store, clock, gateway, queue, holders, max_seconds=2.0).run_account(
        ACCT, "batch-1"
    )
    assert report.result == "db_unavailable" and report.handed_off
    assert holders == {}  # released
    assert queue.handed_off == [(ACCT, "batch-1")]  # and back on the queue
    # sent once, outcome not recorded: the next holder looks them up before any resend
    assert all(r.status is TxStatus.DISPATCHING for r in rows)
    assert all(gateway.sends(r.key) == 1 for r in rows)


def test_the_first_claim_that_takes_the_fencing_token_is_retried_too() -> None:
    clock = FakeClock()
    store, gateway, queue, holders = FlakyStore(clock), FakeGateway(), FakeQueue(), {}
    rows = store.add(ACCT, 1, 2)
    drainer = _drainer(store, clock, gateway, queue, holders)
    store.fail("fence_and_claim", ("before", ADMIN_SHUTDOWN), ("before", ADMIN_SHUTDOWN))
    report = drainer.run_account(ACCT, "batch-1")
    assert report.result == "processed" and store.statuses() == {"succeeded": 2}
    assert all(gateway.sends(r.key) == 1 for r in rows)
    assert all(r.lookups == 0 for r in rows)  # nothing was claimed before: nothing in doubt
    # and past the bound: released, handed back, nothing sent, nothing held
    rows = store.add(ACCT, 2, 2)
    store.fail("fence_and_claim", *[("before", ADMIN_SHUTDOWN)] * 1000)
    report = drainer.run_account(ACCT, "batch-2")
    assert report.result == "db_unavailable" and queue.handed_off == [(ACCT, "batch-2")]
    assert holders == {} and all(gateway.sends(r.key) == 0 for r in rows)
