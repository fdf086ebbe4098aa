"""A threads worker starts all its threads once it is ready (WORKER_PRESTART_THREADS, on by
default): a burst of messages then waits for no thread start on the consumer's thread
(issue 13, scenario 5). Real workers, counted in /proc."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest

from payment_worker.db.engine import application_name
from payment_worker.dev.local_cluster import LocalCluster
from tests.conftest import PwEnv, logged_events, wait_until


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _backends(pw_env: PwEnv, pid: int) -> int:
    """Postgres connections of worker process ``pid`` (named after it)."""
    with psycopg.connect(pw_env.database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (application_name(pid),),
        ).fetchone()
    return int(row[0]) if row else 0


def _env(pool: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_POOL", "WORKER_CONCURRENCY")}
    env.update({"WORKER_POOL": pool, "WORKER_CONCURRENCY": "60", "LOG_LEVEL": "INFO"})
    env.update({"LOG_JSON": "true", "METRICS_PORT": "0", "DB_POOL_SIZE": "4", **extra})
    return env


def test_a_threads_worker_starts_every_slot_once_ready(pw_env: PwEnv, tmp_path: Path) -> None:
    with LocalCluster(workdir=tmp_path, env=_env("threads"), pool=None, concurrency=None) as c:
        worker = c.start_worker()
        wait_until(lambda: logged_events(worker.log_path, "heap_frozen"), 60, "worker ready")
        [started] = logged_events(worker.log_path, "threads_prestarted")
        assert started["threads"] == 60
        # and its connections: a Redis connection per 10 slots, its Postgres pool
        [opened] = logged_events(worker.log_path, "connections_opened")
        assert (opened["redis"], opened["postgres"]) == (6, 4)
        assert _backends(pw_env, worker.pid) == 4
        # the 60 slots, besides Celery's own threads and ours (sweeper, renewer, heartbeat)
        assert _threads(worker.pid) >= 60


def test_off_the_threads_start_with_the_tasks(pw_env: PwEnv, tmp_path: Path) -> None:
    env = _env("threads", WORKER_PRESTART_THREADS="false", WORKER_OPEN_CONNECTIONS="false")
    with LocalCluster(workdir=tmp_path, env=env, pool=None, concurrency=None) as c:
        worker = c.start_worker()
        wait_until(lambda: logged_events(worker.log_path, "heap_frozen"), 60, "worker ready")
        assert logged_events(worker.log_path, "threads_prestarted") == []
        assert _threads(worker.pid) < 60
        assert logged_events(worker.log_path, "connections_opened") == []


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_other_pools_start_no_threads(pw_env: PwEnv, tmp_path: Path, pool: str) -> None:
    env = _env(pool, WORKER_CONCURRENCY="2")
    with LocalCluster(workdir=tmp_path, env=env, pool=None, concurrency=None) as c:
        worker = c.start_worker()
        wait_until(lambda: logged_events(worker.log_path, "heap_frozen"), 60, "worker ready")
        assert logged_events(worker.log_path, "threads_prestarted") == []
