"""No account stays locked behind a holder blocked in Postgres: real Postgres, Redis, simulator.

A real second connection holds a row lock (``SELECT ... FOR UPDATE`` in an open transaction)
or a table lock, the way an operator's forgotten session or a long migration would. The
holder's statement gives up after ``DB_LOCK_TIMEOUT_MS`` / ``DB_STATEMENT_TIMEOUT_MS``, its
account lock is free again, and another run drains the account once the blocker is gone;
the simulator's ledger shows that nothing was paid twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy
from psycopg import errors as pg_errors

from payment_worker import runtime
from payment_worker.dev.samples import make_batches
from payment_worker.locks.account_lock import lock_is_held
from payment_worker.producer.submit import submit_batch
from payment_worker.worker import drain
from payment_worker.worker.sweeper import run_sweep
from tests.conftest import PwEnv
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
