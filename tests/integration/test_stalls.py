"""No account stays locked behind a holder blocked in Postgres: real Postgres, Redis, simulator.

A real second connection holds a row lock (``SELECT ... FOR UPDATE`` in an open transaction)
or a table lock, the way an operator's forgotten session or a long migration would. Either
the holder's statement gives up (``DB_LOCK_TIMEOUT_MS`` / ``DB_STATEMENT_TIMEOUT_MS``) and its
account lock is free again at once, or the holder stays blocked and its watchdog stops
renewing after ``LOCK_MAX_STALL_SECONDS`` of silence, so the lock expires and another worker
takes the account over behind the fence. Another run drains the account once the blocker is
gone, and the simulator's ledger shows that nothing was paid twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy
from prometheus_client import REGISTRY
from psycopg import errors as pg_errors

from payment_worker import runtime
from payment_worker.dev.samples import make_batches
from payment_worker.errors import LockLost
from payment_worker.locks.account_lock import AccountLock, lock_is_held
from payment_worker.producer.submit import submit_batch
from payment_worker.worker import drain
from payment_worker.worker.sweeper import run_sweep
from tests.conftest import PwEnv, wait_until
from tests.sim_fixtures import SimHandle

ACCT = "acct-0000"
STATEMENT_TIMEOUT_MS = 2000
LOCK_TIMEOUT_MS = 300


@pytest.fixture
def res(
    pw_env: PwEnv, gateway_sim: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> Iterator[runtime.Runtime]:
    monkeypatch.setenv("DB_STATEMENT_TIMEOUT_MS", str(STATEMENT_TIMEOUT_MS))
    monkeypatch.setenv("DB_LOCK_TIMEOUT_MS", str(LOCK_TIMEOUT_MS))
    monkeypatch.setenv("RETRY_BASE_DELAY", "0.05")
    monkeypatch.setenv("RETRY_MAX_DELAY", "0.2")
    monkeypatch.setenv("HOLD_WAIT_MAX_SECONDS", "1.0")
    monkeypatch.setenv("SWEEPER_STALE_AFTER", "1")
    runtime.reset()  # rebuilt from the settings above
    yield runtime.current()
    runtime.reset()


def _submit(items: int = 4) -> str:
    [batch] = make_batches(batches=1, items=items, accounts=1, prefix="s")
    assert submit_batch(batch, enqueue=False).status == "accepted"
    return str(batch["batch_id"])


def _statuses(db: psycopg.Connection[Any]) -> dict[str, int]:
    rows = db.execute("SELECT status, count(*) FROM transactions GROUP BY status").fetchall()
    return {r[0]: r[1] for r in rows}


def test_both_engines_start_with_the_timeouts(res: runtime.Runtime) -> None:
    for engine in (res.engine, res.fence_engine):
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "2s"
            assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "300ms"
    t0 = time.monotonic()
    with pytest.raises(sqlalchemy.exc.OperationalError) as caught, res.engine.connect() as conn:
        conn.exec_driver_sql("SELECT pg_sleep(30)")
    assert isinstance(caught.value.orig, pg_errors.QueryCanceled)
    assert time.monotonic() - t0 < STATEMENT_TIMEOUT_MS / 1000 + 1.0


def test_a_holder_blocked_on_a_row_gives_up_and_the_account_moves_on(
    res: runtime.Runtime,
    pw_env: PwEnv,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch_id = _submit(4)
    last_tx = db_conn.execute("SELECT max(transaction_id) FROM transactions").fetchone()
    assert last_tx is not None
    # an open transaction of somebody else: it locks one claimed row while the holder sends
    blocker = psycopg.connect(pw_env.database_url)
    blocked_at: list[float] = []
    real_create = res.gateway.create_payment

    def create_then_block(*args: Any, **kw: Any) -> Any:
        if not blocked_at:
            blocker.execute(
                "SELECT id FROM transactions WHERE transaction_id = %s FOR UPDATE", (last_tx[0],)
            )
            blocked_at.append(time.monotonic())
        return real_create(*args, **kw)

    monkeypatch.setattr(res.gateway, "create_payment", create_then_block)
    try:
        # the chunk's outcomes cannot be written while the row is locked: the record
        # statement waits DB_LOCK_TIMEOUT_MS, then the drain stops with the database's error
        with pytest.raises(sqlalchemy.exc.OperationalError) as caught:
            drain.run_account(ACCT, batch_id, res)
        gave_up_after = time.monotonic() - blocked_at[0]
        assert isinstance(caught.value.orig, pg_errors.LockNotAvailable)
        assert gave_up_after < LOCK_TIMEOUT_MS / 1000 + 2.0, gave_up_after
        # the account lock is free at once, not when some timeout in Redis runs out
        assert not lock_is_held(res.redis, ACCT, res.settings.redis_key_prefix)
        assert _statuses(db_conn) == {"dispatching": 4}
        assert gateway_sim.ledger()["payments_sent"] == 4
    finally:
        blocker.rollback()
        blocker.close()
    monkeypatch.setattr(res.gateway, "create_payment", real_create)
    # nobody is left to drain it: the sweeper re-enqueues the account once it is stale ...
    db_conn.execute("UPDATE transactions SET updated_at = now() - interval '1 minute'")
    assert run_sweep(res)["reenqueued"] == [batch_id]
    # ... and the run that message starts looks every claimed item up: paid once each
    report = drain.run_account(ACCT, batch_id, res)
    assert report.result == "processed" and report.items == 4
    assert _statuses(db_conn) == {"succeeded": 4}
    ledger = gateway_sim.ledger()
    assert ledger["payments_sent"] == 4 and ledger["double_payments"] == []
    looked = db_conn.execute("SELECT lookups FROM transactions ORDER BY id").fetchall()
    assert looked == [(1,)] * 4


def _lost(reason: str) -> float:
    return REGISTRY.get_sample_value("payment_worker_lock_lost_total", {"reason": reason}) or 0.0


# a 600 ms TTL with a 100 ms margin: a renewer thread kept off the CPU by other tests for
# 300 ms would lose the lock while it progresses, so it runs alone
@pytest.mark.exclusive
def test_the_watchdog_keeps_a_lock_that_progresses_and_drops_a_silent_one(
    pw_env: PwEnv, redis_client: redis.Redis
) -> None:
    rt = runtime.current()
    lost: list[str] = []
    ttl_ms, max_stall = 600, 0.5
    lock = AccountLock(
        redis_client,
        ACCT,
        engine=rt.fence_engine,
        ttl_ms=ttl_ms,
        safety_margin_ms=100,
        max_stall=max_stall,
        on_lost=lost.append,
    )
    rival = rt.account_lock(ACCT)
    assert lock.acquire()
    # working: three stall periods with progress every 50 ms, the lock stays ours
    end = time.monotonic() + 3 * max_stall
    while time.monotonic() < end:
        lock.progress()
        lock.ensure_held()
        time.sleep(0.05)
    assert lost == [] and redis_client.exists(lock.key)
    before = _lost("stalled")
    lock.progress()  # the last report: silent from now on
    silent_from = time.monotonic()
    wait_until(lambda: lost != [], 3, "the watchdog to give up")
    gave_up_after = time.monotonic() - silent_from
    assert lost == ["stalled"] and _lost("stalled") == before + 1
    # at the first tick after the bound (TTL/3 apart), plus scheduling slack
    assert max_stall <= gave_up_after <= max_stall + ttl_ms / 3000 + 0.5, gave_up_after
    # no longer renewed: the key expires within one TTL and another worker gets the account
    wait_until(lambda: not redis_client.exists(lock.key), ttl_ms / 1000 + 0.2, "expiry")
    assert rival.acquire()
    assert (rival.fence_token or 0) > (lock.fence_token or 0)
    with pytest.raises(LockLost, match="stalled"):
        lock.ensure_held()
    assert not lock.release()  # not ours any more: nothing deleted
    rival.ensure_held()
    assert rival.release()


def test_a_holder_blocked_in_postgres_is_taken_over_behind_the_fence(
    res: runtime.Runtime,
    pw_env: PwEnv,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # statements may wait long here: it is the watchdog's stall rule that frees the account
    monkeypatch.setenv("DB_STATEMENT_TIMEOUT_MS", "30000")
    monkeypatch.setenv("DB_LOCK_TIMEOUT_MS", "30000")
    monkeypatch.setenv("LOCK_TTL_MS", "600")
    monkeypatch.setenv("LOCK_SAFETY_MARGIN_MS", "100")
    runtime.reset()
    rt = runtime.current()
    # below what the settings accept (the gateway's own waits), to keep the test short
    monkeypatch.setattr(rt.settings, "lock_max_stall_seconds", 1.0)
    batch_id = _submit(4)
    reports: dict[str, drain.DrainReport] = {}

    def run(name: str) -> threading.Thread:
        t = threading.Thread(
            target=lambda: reports.update({name: drain.run_account(ACCT, batch_id, rt)})
        )
        t.start()
        return t

    def waiting_on_locks() -> int:
        row = db_conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
        return int(row[0]) if row else 0

    blocker = psycopg.connect(pw_env.database_url)
    threads = []
    try:
        # somebody's long transaction holds the batch's row: a first claim issues its fencing
        # token, claims, and then waits to mark the batch started. (A lock on a whole table
        # would stop the claim's statement before its fence, and two claims released
        # together would race for the older token.)
        blocker.execute("SELECT 1 FROM batches WHERE batch_id = %s FOR UPDATE", (batch_id,))
        before = _lost("stalled")
        started = time.monotonic()
        threads.append(run("first"))
        wait_until(lambda: waiting_on_locks() == 1, 5, "the first holder to block")
        # silent for LOCK_MAX_STALL_SECONDS: no renewal, and the key expires within one TTL
        wait_until(lambda: _lost("stalled") == before + 1, 3, "the watchdog to give up")
        assert time.monotonic() - started <= 1.0 + 0.2 + 1.0  # stall + TTL/3 + slack
        wait_until(lambda: not lock_is_held(rt.redis, ACCT), 1.0, "the lock to expire")
        assert threads[0].is_alive()  # still blocked in its statement
        # another worker takes the account: a newer fencing token while the first waits
        monkeypatch.setattr(rt.settings, "lock_max_stall_seconds", 120.0)
        threads.append(run("second"))
        # the second's first claim waits for the first's: the first claim issued its token
        # (uncommitted) before it blocked on the batch, the second's waits on that fence row
        wait_until(lambda: waiting_on_locks() == 2, 5, "the second holder to block too")
        assert lock_is_held(rt.redis, ACCT)
    finally:
        blocker.rollback()  # the blocker is gone
        blocker.close()
        for t in threads:
            t.join(30)
    fence = db_conn.execute(
        "SELECT fence_token FROM account_fences WHERE account_id = %s", (ACCT,)
    ).fetchone()
    assert fence == (2,)  # the first claim's token, then the newer holder's
    # the blocked holder's claim committed under token 1, then its lost lock stopped it
    # before any send; the newer holder found those items in doubt and looked each up first
    assert reports["first"].result == "lock_lost" and reports["first"].items == 0
    assert reports["second"].result == "processed" and reports["second"].items == 4
    assert _statuses(db_conn) == {"succeeded": 4}
    lookups = db_conn.execute("SELECT sum(lookups) FROM transactions").fetchone()
    assert lookups == (4,)
    ledger = gateway_sim.ledger()
    assert ledger["payments_sent"] == 4 and ledger["double_payments"] == []
    assert not lock_is_held(rt.redis, ACCT)
