"""The service behind a real PgBouncer in transaction pooling mode (DB_PGBOUNCER=true).

Debian's PgBouncer 1.18 refuses libpq's ``options`` startup parameter and cannot carry a
prepared statement from one transaction to the next: with ``DB_PGBOUNCER=true`` the service
sends no ``options`` and prepares nothing, and the timeouts come from the database's own
settings. The end-to-end flow (producer, two real workers, the simulator) runs through it.
Missing pgbouncer skips the test locally and fails it in CI (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from payment_worker import runtime
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.reconcile import reconcile
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import PwEnv
from tests.db_watch import wait_terminal
from tests.pgbouncer import Bouncer, pgbouncer_binary, run_pgbouncer

POOL = 6  # PgBouncer's server connections for the test database


def _need_pgbouncer() -> None:
    # skipped locally without it, a failure in CI (.ci/run installs it)
    if pgbouncer_binary() is None:
        message = "pgbouncer is not installed (.ci/run installs the Debian package)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


@pytest.fixture
def bouncer(pw_env: PwEnv) -> Iterator[Bouncer]:
    _need_pgbouncer()
    # behind a transaction pooler the timeouts come from the server (docs/configuration.md),
    # set before PgBouncer opens its first server connection
    dbname = str(conninfo_to_dict(pw_env.database_url)["dbname"])
    with psycopg.connect(pw_env.database_url, autocommit=True) as direct:
        direct.execute(f"ALTER DATABASE \"{dbname}\" SET statement_timeout = '30s'")
        direct.execute(f"ALTER DATABASE \"{dbname}\" SET lock_timeout = '10s'")
    with run_pgbouncer(pw_env.database_url, pool_size=POOL) as b:
        yield b


def test_the_end_to_end_flow_through_pgbouncer_in_transaction_mode(
    pw_env: PwEnv, bouncer: Bouncer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the premise: PgBouncer 1.18 refuses what the service sends by default
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter"):
        psycopg.connect(bouncer.url, options="-c statement_timeout=30000").close()
    dbname = str(conninfo_to_dict(pw_env.database_url)["dbname"])
    monkeypatch.setenv("DATABASE_URL", bouncer.url)
    monkeypatch.setenv("DB_PGBOUNCER", "true")
    runtime.reset()
    rt = runtime.current()
    with rt.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "30s"
        assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "10s"

    env = {
        **os.environ,
        "METRICS_PORT": "0",
        "SWEEPER_INTERVAL": "2",
        "SWEEPER_STALE_AFTER": "10",
        "GATEWAY_RATE_PER_SECOND": "100",
        "DB_POOL_SIZE": "4",
    }
    total = 40 * 20
    with LocalCluster(workdir=tmp_path, env=env, concurrency=8) as cluster:
        cluster.start_simulator(rate=100)
        # the producer goes through PgBouncer too (this process's runtime)
        for b in make_batches(batches=40, items=20, accounts=10, prefix="pgb", reject_every=97):
            assert submit_batch(b).status == "accepted"
        cluster.start_worker()
        cluster.start_worker()
        counts = wait_terminal(pw_env.database_url, total, timeout=180)
        ledger = cluster.ledger()
        logs = "".join(p.log_path.read_text(errors="replace") for p in cluster.processes)
    assert counts.get("succeeded", 0) + counts.get("failed", 0) == total, (counts, logs[-3000:])
    assert counts.get("failed", 0) == total // 97
    with rt.engine.connect() as conn:
        rec = reconcile(conn, ledger)
    assert rec.ok, rec.summary()
    assert ledger["double_payments"] == []
    assert max(ledger["sends"].values()) == 1
    assert ledger["http_429_by_cause"]["concurrency"] == 0
    # no task failed, and no statement met a prepared statement another client made
    assert "raised unexpected" not in logs, logs[-3000:]
    assert "prepared statement" not in logs, logs[-3000:]
    # the database gives both timeouts: the workers' start-up check found nothing loose
    assert "db_timeout_loose" not in logs and "db_timeouts_not_checked" not in logs
    # the work went through PgBouncer: thousands of transactions over its few server
    # connections
    stats = {r["database"]: r for r in bouncer.show("STATS")}
    assert int(str(stats[dbname]["total_xact_count"])) > total / 20 * 2
    servers = [r for r in bouncer.show("SERVERS") if r["database"] == dbname]
    assert len(servers) <= POOL


def test_a_worker_behind_pgbouncer_names_the_timeouts_the_server_leaves_loose(
    pw_env: PwEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_pgbouncer()
    # the role and database give no statement timeout, and a lock timeout looser than asked
    dbname = str(conninfo_to_dict(pw_env.database_url)["dbname"])
    with psycopg.connect(pw_env.database_url, autocommit=True) as direct:
        direct.execute(f"ALTER DATABASE \"{dbname}\" SET lock_timeout = '60s'")
    with run_pgbouncer(pw_env.database_url, pool_size=2) as b:
        env = {**os.environ, "DATABASE_URL": b.url, "DB_PGBOUNCER": "true", "METRICS_PORT": "0"}
        with LocalCluster(workdir=tmp_path, env=env, concurrency=2) as cluster:
            worker = cluster.start_worker()
            deadline = time.monotonic() + 60
            lines: list[dict[str, object]] = []
            while time.monotonic() < deadline and len(lines) < 2:
                time.sleep(0.2)
                text = worker.log_path.read_text(errors="replace")
                lines = [
                    json.loads(line)
                    for line in text.splitlines()
                    if line.startswith("{") and '"db_timeout_loose"' in line
                ]
    assert sorted((x["setting"], x["server_ms"], x["wanted_ms"]) for x in lines) == [
        ("lock_timeout", 60_000, 10_000),
        ("statement_timeout", 0, 30_000),
    ], text[-3000:]
    assert all(x["level"] == "warning" for x in lines)
