"""A worker draining against the simulator while a fault hits one of its services: the harness
of the blip tests (``tests/integration/test_db_blips.py``, ``test_redis_blips.py``). A blip
must cost a pause or a retry, never a task: no Celery failure, no ``task_crashed`` dead
letter, every item finished, nothing paid twice."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from payment_worker import runtime
from payment_worker.dev.local_cluster import LocalCluster, free_port
from payment_worker.dev.reconcile import reconcile
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import PwEnv
from tests.db_watch import scrape, wait_terminal


def run_with_fault(
    pw_env: PwEnv,
    tmp_path: Path,
    *,
    accounts: int,
    items: int,
    fault: Callable[[int], None],
    env: dict[str, str] | None = None,
    latency_ms: int = 20,
    concurrency: int = 16,
) -> dict[str, Any]:
    """Submit, start one worker of ``concurrency`` slots, run ``fault(worker_pid)`` in a
    thread while it drains, and collect what the assertions need."""
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
    with LocalCluster(workdir=tmp_path, env=full_env, concurrency=concurrency) as cluster:
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


def series(metrics: dict[Any, float], name: str) -> dict[str, float]:
    """One counter's samples by its only label's value."""
    out: dict[str, float] = {}
    for (n, labels), value in metrics.items():
        if n == name and value > 0:  # label values may be preset at 0
            out[",".join(v for _, v in labels)] = value
    return out


def assert_nothing_lost_or_doubled(out: dict[str, Any]) -> None:
    counts, log = out["counts"], out["log"]
    assert counts.get("succeeded", 0) == out["total"], (counts, log[-4000:])
    assert out["reconcile"].ok, out["reconcile"].summary()
    assert out["ledger"]["double_payments"] == []
    assert max(out["ledger"]["sends"].values()) == 1
    # no task failed: Celery logged no failure, the crash hooks wrote no dead letter
    assert "raised unexpected" not in log, log[-4000:]
    assert out["dead_letters"] == 0
