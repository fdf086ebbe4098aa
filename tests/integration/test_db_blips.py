"""A database blip costs a retry, not a task (issue 15): real workers draining against the
simulator while their Postgres connections are killed, the database refuses connections, or
the server restarts.

Each test asserts that no task failed (no Celery failure, no ``task_crashed`` dead letter),
that every item finished, that nothing was paid twice (the simulator's ledger, reconciled with
Postgres), and that the retries are visible (``payment_worker_db_retries_total{reason}``, the
``db_retry`` log event). Past ``DB_RETRY_MAX_SECONDS`` the account is released and re-enqueued
(``db_unavailable``), and resumes when the database is back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from payment_worker import runtime
from payment_worker.dev.local_cluster import LocalCluster, free_port
from payment_worker.dev.reconcile import reconcile
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from payment_worker.settings import Settings
from tests.conftest import PwEnv, ServiceUrls, _with_db
from tests.db_watch import scrape, terminate_backends, wait_terminal

# run alone, after the parallel part of `make test`: it restarts the embedded PostgreSQL: every
# other session's connections would die
pytestmark = pytest.mark.exclusive


def _run(
    pw_env: PwEnv,
    tmp_path: Path,
    *,
    accounts: int,
    items: int,
    fault: Callable[[int], None],
    env: dict[str, str] | None = None,
    latency_ms: int = 20,
) -> dict[str, Any]:
    """Submit, start one worker, run ``fault(worker_pid)`` in a thread while it drains, and
    collect what the assertions need."""
    port = free_port()
    full_env = {
        **os.environ,
        "METRICS_PORT": str(port),
        "DB_POOL_SIZE": "4",
        "GATEWAY_RATE_PER_SECOND": "100",
        "SWEEPER_INTERVAL": "2",
        "SWEEPER_STALE_AFTER": "10",
        "PROCESS_CHUNK_SIZE": "5",
        **(env or {}),
    }
    total = accounts * items
    with LocalCluster(workdir=tmp_path, env=full_env, concurrency=16) as cluster:
        cluster.start_simulator(rate=100, latency_ms=latency_ms)
        for b in make_batches(batches=accounts, items=items, accounts=accounts, prefix="blip"):
            assert submit_batch(b).status == "accepted"
        runtime.reset()  # this process's pool must not sit on connections the faults kill
        worker = cluster.start_worker()
        # the fault starts once the drain is under way (a tenth of the items finished)
        wait_terminal(pw_env.database_url, total // 10, timeout=120)
        faulting = threading.Thread(target=fault, args=(worker.pid,), daemon=True)
        faulting.start()
        counts = wait_terminal(pw_env.database_url, total, timeout=240)
        faulting.join(60)
        metrics = scrape(port)
        ledger = cluster.ledger()
        log = (tmp_path / "worker1.log").read_text(errors="replace")
    with psycopg.connect(pw_env.database_url, autocommit=True) as db:
        row = db.execute("SELECT count(*) FROM dead_letters").fetchone()
    with runtime.current().engine.connect() as conn:
        rec = reconcile(conn, ledger)
    return {
        "total": total,
        "counts": counts,
        "metrics": metrics,
        "ledger": ledger,
        "log": log,
        "dead_letters": row[0] if row else None,
        "reconcile": rec,
    }


def _series(metrics: dict[Any, float], name: str) -> dict[str, float]:
    """One counter's samples by its only label's value."""
    out: dict[str, float] = {}
    for (n, labels), value in metrics.items():
        if n == name and value > 0:  # label values may be preset at 0
            out[",".join(v for _, v in labels)] = value
    return out


def _assert_nothing_lost_or_doubled(out: dict[str, Any]) -> None:
    counts, log = out["counts"], out["log"]
    assert counts.get("succeeded", 0) == out["total"], (counts, log[-4000:])
    assert out["reconcile"].ok, out["reconcile"].summary()
    assert out["ledger"]["double_payments"] == []
    assert max(out["ledger"]["sends"].values()) == 1
    # no task failed: Celery logged no failure, the crash hooks wrote no dead letter
    assert "raised unexpected" not in log, log[-4000:]
    assert out["dead_letters"] == 0


def test_killed_connections_are_retried_inside_the_drain(
    pw_env: PwEnv, service_urls: ServiceUrls, tmp_path: Path
) -> None:
    admin = _with_db(service_urls.pg_admin, "postgres")
    killed: list[int] = []

    def kill_backends(pid: int) -> None:
        # a real admin shutdown (57P01) of every connection of the worker, again and again
        # while it drains
        for _ in range(40):
            killed.append(terminate_backends(admin, pid))
            time.sleep(0.25)

    out = _run(pw_env, tmp_path, accounts=20, items=40, fault=kill_backends)
    _assert_nothing_lost_or_doubled(out)
    assert sum(killed) >= 10, killed
    retries = _series(out["metrics"], "payment_worker_db_retries_total")
    assert sum(retries.values()) > 0, retries
    assert set(retries) <= {"admin_shutdown", "disconnect", "connection"}, retries
    assert "db_retry" in out["log"]
    # nothing needed handing back: every blip was shorter than DB_RETRY_MAX_SECONDS
    executions = _series(out["metrics"], "payment_worker_task_executions_total")
    assert executions.get("db_unavailable", 0) == 0, executions
    print(f"\n{sum(killed)} backends killed; retries {retries}; executions {executions}")


def test_past_the_bound_the_account_is_handed_back_and_resumes(
    pw_env: PwEnv, service_urls: ServiceUrls, tmp_path: Path
) -> None:
    admin = _with_db(service_urls.pg_admin, "postgres")
    dbname = str(conninfo_to_dict(pw_env.database_url)["dbname"])
    outage: list[float] = []

    def refuse_connections(pid: int) -> None:
        # the database refuses every connection for 5 s, five times the retry bound
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
            t0 = time.monotonic()
            terminate_backends(admin, pid)
            time.sleep(5.0)
            conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')
            outage.append(time.monotonic() - t0)

    out = _run(
        pw_env,
        tmp_path,
        accounts=10,
        items=60,
        fault=refuse_connections,
        env={"DB_RETRY_MAX_SECONDS": "1", "DB_POOL_TIMEOUT": "1"},
        latency_ms=50,
    )
    assert outage and outage[0] >= 5.0
    _assert_nothing_lost_or_doubled(out)
    executions = _series(out["metrics"], "payment_worker_task_executions_total")
    # the holders gave their accounts back (released, re-enqueued) instead of failing
    assert executions.get("db_unavailable", 0) > 0, executions
    assert "db_retry_exhausted" in out["log"] and "db_unavailable" in out["log"]
    print(f"\noutage {outage[0]:.1f}s; executions {executions}")


def _embedded_home(service_urls: ServiceUrls) -> Path | None:
    """The embedded server's home when the tests run on it (no DATABASE_URL of their own)."""
    from payment_worker.embedded.postgres_server import pg_socket_dir

    home = Settings().home
    return home if str(pg_socket_dir(home)) in service_urls.pg_admin else None


def test_a_postgres_restart_costs_a_pause_not_a_task(
    pw_env: PwEnv, service_urls: ServiceUrls, tmp_path: Path
) -> None:
    home = _embedded_home(service_urls)
    if home is None:
        pytest.skip("restarts only the embedded server (DATABASE_URL names a shared one)")
    from payment_worker import embedded
    from payment_worker.embedded.postgres_server import postmaster

    restarted: list[float] = []

    def restart(pid: int) -> None:
        pm = postmaster(home)
        assert pm is not None
        t0 = time.monotonic()
        os.kill(pm[0], signal.SIGINT)  # fast shutdown: every session gets 57P01
        while postmaster(home) is not None:
            time.sleep(0.05)
        embedded.postgres_url(home, Settings().embedded_pg_os_user)  # starts it again
        restarted.append(time.monotonic() - t0)

    out = _run(pw_env, tmp_path, accounts=20, items=40, fault=restart, latency_ms=50)
    assert restarted, "the server was not restarted"
    _assert_nothing_lost_or_doubled(out)
    retries = _series(out["metrics"], "payment_worker_db_retries_total")
    assert sum(retries.values()) > 0, retries
    print(f"\nrestart took {restarted[0]:.1f}s; retries {retries}")
