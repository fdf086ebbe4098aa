"""DB_POOL_SIZE is a hard bound: a real worker at high concurrency, holders overlapping on a
slow gateway, never has more Postgres backends than its pool, and still drains fast because
no connection is held across a gateway call."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from payment_worker import runtime
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.reconcile import reconcile
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import PwEnv, ServiceUrls, _with_db
from tests.db_watch import BackendWatch, wait_terminal

POOL_SIZE = 4
CONCURRENCY = 50
ACCOUNTS, ITEMS = 100, 8
LATENCY_MS = 100


def test_a_worker_never_exceeds_its_pool_whatever_its_concurrency(
    pw_env: PwEnv, service_urls: ServiceUrls, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "METRICS_PORT": "0",
        "DB_POOL_SIZE": str(POOL_SIZE),
        "GATEWAY_RATE_PER_SECOND": "100",
        "PROCESS_CHUNK_SIZE": "20",
    }
    total = ACCOUNTS * ITEMS
    with LocalCluster(workdir=tmp_path, env=env, concurrency=CONCURRENCY) as cluster:
        cluster.start_simulator(rate=100, latency_ms=LATENCY_MS)
        for b in make_batches(batches=ACCOUNTS, items=ITEMS, accounts=ACCOUNTS, prefix="pool"):
            assert submit_batch(b).status == "accepted"
        worker = cluster.start_worker()
        admin = _with_db(service_urls.pg_admin, "postgres")
        started = time.monotonic()
        with BackendWatch(admin, pw_env.database_url, worker.pid) as watch:
            counts = wait_terminal(pw_env.database_url, total, timeout=240)
        elapsed = time.monotonic() - started
        ledger = cluster.ledger()
        log = (tmp_path / "worker1.log").read_text(errors="replace")
    assert counts.get("succeeded", 0) == total, (counts, log[-3000:])
    # the bound: every sample, whatever the 50 threads were doing
    assert watch.backends, "no sample taken"
    assert max(watch.backends) <= POOL_SIZE, watch.backends
    assert max(watch.backends) >= 1  # the samples did see the worker's connections
    # and the threads were not throttled to the pool: far more accounts in flight at once
    # (claimed, waiting on the gateway) than connections
    assert max(watch.in_flight) > 3 * POOL_SIZE, max(watch.in_flight)
    print(
        f"\n{total} items in {elapsed:.1f}s ({total / elapsed:.0f} items/s, shared machine);"
        f" backends max {max(watch.backends)} (DB_POOL_SIZE={POOL_SIZE}),"
        f" accounts in flight max {max(watch.in_flight)}"
    )
    assert "raised unexpected" not in log, log[-3000:]  # no task failed
    with runtime.current().engine.connect() as conn:
        rec = reconcile(conn, ledger)
    assert rec.ok, rec.summary()
    assert ledger["double_payments"] == []


def _round_trips(trace: str) -> int:
    """Client round trips in a libpq trace: each simple Query or extended-protocol Sync."""
    sent = [line.split("\t") for line in trace.splitlines()]
    return sum(1 for f in sent if len(f) > 3 and f[1] == "F" and f[3] in ("Query", "Sync"))


def test_each_store_call_and_the_fence_cost_one_round_trip(pw_env: PwEnv, tmp_path: Path) -> None:
    from sqlalchemy import event

    from payment_worker.db.engine import autocommit, make_engine
    from payment_worker.db.fences import issue_fence_token
    from payment_worker.db.work_store import PgWorkStore

    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = make_engine(url, pool_size=1)
    trace_path = tmp_path / "libpq.trace"
    with trace_path.open("w") as trace_file:

        @event.listens_for(engine, "connect")
        def _trace(dbapi_conn: Any, record: Any) -> None:
            dbapi_conn.pgconn.trace(trace_file.fileno())

        store = PgWorkStore(autocommit(engine))
        issue_fence_token(autocommit(engine), "acct-rt")  # warms the one connection up

        def five_calls() -> str:
            trace_file.flush()
            start = trace_path.stat().st_size
            token = issue_fence_token(autocommit(engine), "acct-rt")
            assert store.claim_due("acct-rt", token, 5) == []
            assert store.complete_and_next_due("acct-rt", token) == ([], None)
            assert store.complete_batches("acct-rt", token) == []
            # a drain's first claim issues its token in the claim's own round trip
            first = store.fence_and_claim("acct-rt", 5)
            assert first == [] and first.fence_token == token + 1
            trace_file.flush()
            return trace_path.read_text()[start:]

        first_run, calls = five_calls(), five_calls()
    engine.dispose()
    # five calls, five round trips: no ping, no BEGIN, no COMMIT, the connection checked out
    # and given back around each
    assert _round_trips(calls) == 5, calls
    # the first run of each of the four drain statements on a connection prepares it first
    assert _round_trips(first_run) == 5 + 4, first_run


def test_an_idle_connection_killed_meanwhile_is_replaced_at_checkout(
    pw_env: PwEnv, monkeypatch: Any
) -> None:
    import psycopg
    import sqlalchemy

    from payment_worker.db import engine as engine_mod
    from payment_worker.db.retry import transient_reason

    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = engine_mod.make_engine(url, pool_size=1, application_name="pw-idle-test")

    def kill() -> None:
        with psycopg.connect(pw_env.database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'pw-idle-test'"
            )

    try:
        with engine.connect() as conn:
            first = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        kill()
        # a connection idle for less than PING_AFTER_IDLE_S is not pinged: its statement
        # fails, transiently (the drain retries it on a fresh connection)
        with pytest.raises(sqlalchemy.exc.DBAPIError) as caught, engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        assert transient_reason(caught.value) is not None
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        assert pid != first
        # idle longer: pinged at checkout, found dead, replaced before the caller sees it
        kill()
        monkeypatch.setattr(engine_mod, "PING_AFTER_IDLE_S", 0.0)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() not in (first, pid)
    finally:
        engine.dispose()
