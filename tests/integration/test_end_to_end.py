"""End to end: real Celery workers, real Postgres and Redis, the simulator over HTTP."""

from __future__ import annotations

import os
import time
from pathlib import Path

from payment_worker import runtime
from payment_worker.db.work import open_counts
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.reconcile import reconcile
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import PwEnv


def wait_terminal(total: int, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        with runtime.current().engine.connect() as conn:
            counts = open_counts(conn)
        if sum(counts.get(s, 0) for s in ("succeeded", "failed", "dead")) >= total:
            return counts
        time.sleep(0.5)
    return counts


def test_100_batches_x_20_items_over_10_accounts(pw_env: PwEnv, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "METRICS_PORT": "0",
        "SWEEPER_INTERVAL": "2",
        "SWEEPER_STALE_AFTER": "10",
        "GATEWAY_RATE_PER_SECOND": "100",
    }
    with LocalCluster(workdir=tmp_path, env=env, concurrency=8) as cluster:
        cluster.start_simulator(rate=100)
        cluster.env.update({"GATEWAY_URL": cluster.sim_url or ""})
        batches = make_batches(batches=100, items=20, accounts=10, prefix="e2e", reject_every=97)
        for b in batches:
            assert submit_batch(b).status == "accepted"
        cluster.start_worker()
        cluster.start_worker()
        cluster.start_beat()
        counts = wait_terminal(2000, timeout=180)
        ledger = cluster.ledger()
    assert counts.get("succeeded", 0) + counts.get("failed", 0) == 2000, counts
    assert counts.get("failed", 0) == 2000 // 97  # exactly the REJECT beneficiaries
    with runtime.current().engine.connect() as conn:
        rec = reconcile(conn, ledger)
    assert rec.ok, rec.summary()
    sent = list(ledger["sends"].values())
    assert sum(sent) == counts["succeeded"] and max(sent) == 1
    assert ledger["double_payments"] == []
    # one request of an account in flight at a time from our side: no 429 for concurrency
    assert ledger["http_429_by_cause"]["concurrency"] == 0, ledger["http_429_by_cause"]
    assert max(ledger["max_in_flight_seen"].values()) == 1
