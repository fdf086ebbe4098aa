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
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from payment_worker.settings import Settings
from tests.blips import assert_nothing_lost_or_doubled, run_with_fault, series
from tests.conftest import PwEnv, ServiceUrls, _with_db
from tests.db_watch import terminate_backends

# run alone, after the parallel part of `make test`: it restarts the embedded PostgreSQL: every
# other session's connections would die
pytestmark = pytest.mark.exclusive


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

    out = run_with_fault(pw_env, tmp_path, accounts=20, items=40, fault=kill_backends)
    assert_nothing_lost_or_doubled(out)
    assert sum(killed) >= 10, killed
    retries = series(out["metrics"], "payment_worker_db_retries_total")
    assert sum(retries.values()) > 0, retries
    assert set(retries) <= {"admin_shutdown", "disconnect", "connection"}, retries
    assert "db_retry" in out["log"]
    # nothing needed handing back: every blip was shorter than DB_RETRY_MAX_SECONDS
    executions = series(out["metrics"], "payment_worker_task_executions_total")
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

    out = run_with_fault(
        pw_env,
        tmp_path,
        accounts=10,
        items=60,
        fault=refuse_connections,
        env={"DB_RETRY_MAX_SECONDS": "1", "DB_POOL_TIMEOUT": "1"},
        latency_ms=50,
    )
    assert outage and outage[0] >= 5.0
    assert_nothing_lost_or_doubled(out)
    executions = series(out["metrics"], "payment_worker_task_executions_total")
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

    out = run_with_fault(pw_env, tmp_path, accounts=20, items=40, fault=restart, latency_ms=50)
    assert restarted, "the server was not restarted"
    assert_nothing_lost_or_doubled(out)
    retries = series(out["metrics"], "payment_worker_db_retries_total")
    assert sum(retries.values()) > 0, retries
    print(f"\nrestart took {restarted[0]:.1f}s; retries {retries}")
