"""``celery control shutdown`` hands the accounts back as SIGTERM does.

Celery sends ``worker_shutting_down`` only from its signal handlers; a worker told to stop by
remote control closed its blueprint and waited for its tasks, whose drains ran their slices
out (``DRAIN_MAX_SECONDS``). The worker's ``HandBackOnStop`` step
(``payment_worker/worker/lifecycle.py``) hands them back at the next safe point instead."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import redis

from payment_worker import runtime
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import PwEnv, wait_until

pytestmark = pytest.mark.integration

SLICE = 30  # DRAIN_MAX_SECONDS here: a drain left to run its slice out takes this long


def test_a_remote_shutdown_hands_the_account_back_at_once(
    pw_env: PwEnv,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**os.environ, "METRICS_PORT": "0", "DRAIN_MAX_SECONDS": str(SLICE)}
    app_redis = redis.Redis.from_url(pw_env.redis_url)
    with LocalCluster(workdir=tmp_path, env=env, concurrency=4) as cluster:
        cluster.start_simulator()
        cluster.configure_simulator(latency_ms=500)  # 40 items: 20 s of payments
        monkeypatch.setenv("GATEWAY_URL", cluster.env["GATEWAY_URL"])
        runtime.reset()
        [batch] = make_batches(batches=1, items=40, accounts=1, prefix="remote")
        worker = cluster.start_worker()
        assert submit_batch(batch).status == "accepted"

        def paying() -> bool:
            row = db_conn.execute(
                "SELECT count(*) FROM transactions WHERE status = 'succeeded'"
            ).fetchone()
            return row is not None and row[0] >= 2

        wait_until(paying, 60, "the worker paying the batch")
        assert app_redis.exists("pw:lock:{acct-0000}")
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "payment_worker",
                "control",
                "shutdown",
                "--destination",
                f"worker1@{socket.gethostname()}",
            ],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # (a worker told to shut down does not reply: Celery's CLI then says so, exit 69)
        assert proc.returncode in (0, 69), proc.stderr
        wait_until(lambda: not worker.alive(), SLICE, "the worker to exit")
        exited = time.monotonic() - started
        log = worker.log_path.read_text(errors="replace")
    # at the next safe point (one request of 0.5 s), not after the rest of the slice
    assert exited < 8, exited  # 2.6 s measured; before, the drain ran on to the batch's end
    assert "worker_handing_back" in log
    assert not app_redis.exists("pw:lock:{acct-0000}")
    rows = db_conn.execute("SELECT status, count(*) FROM transactions GROUP BY status").fetchall()
    statuses = dict(rows)
    assert "dispatching" not in statuses and "unknown" not in statuses, statuses
    assert statuses.get("succeeded", 0) < 40, statuses  # handed back before the end
