"""``payment-worker demo``: the main job end to end on this machine.

Starts (or reuses) the embedded PostgreSQL and Redis, migrates the schema, starts the gateway
simulator, a Celery worker and beat, submits a sample batch file, shows progress until every
transaction is terminal, and reconciles Postgres with the simulator's ledger.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from payment_worker.db import migrate, reports
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.reconcile import reconcile
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES
from payment_worker.ops.redaction import mask_url
from payment_worker.runtime import Runtime

# shipped inside the package, so an installed wheel finds it from any working directory
SAMPLE = Path(__file__).resolve().parent / "sample-batch.json"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _load_batches(path: Path, run_id: str) -> list[dict[str, Any]]:
    """The file's batches with ids made unique to this run, so the demo can run again."""
    data = json.loads(path.read_text())
    batches = data if isinstance(data, list) else [data]
    for b in batches:
        b["batch_id"] = f"{b['batch_id']}-{run_id}"
        for item in b["items"]:
            item["transaction_id"] = f"{item['transaction_id']}-{run_id}"
    return batches


def _progress(engine: Engine, batch_ids: list[str]) -> dict[str, int]:
    with engine.connect() as conn:
        return reports.transaction_counts(conn, batch_ids)


def _batch_summaries(engine: Engine, batch_ids: list[str]) -> list[tuple[str, str, str]]:
    with engine.connect() as conn:
        rows = reports.batch_summaries(conn, batch_ids)
    out: dict[tuple[str, str], list[str]] = {}
    for batch_id, bstatus, tstatus, n in rows:
        out.setdefault((batch_id, bstatus), []).append(f"{tstatus}={n}")
    return [(b, st, " ".join(parts)) for (b, st), parts in out.items()]


def run_demo(
    rt: Runtime, file: str | None = None, *, workers: int = 1, timeout: float = 180.0
) -> int:
    """Run the demo; returns the exit code (0 when every item is terminal and reconciled)."""
    from payment_worker.producer.submit import submit_batch

    s = rt.settings
    path = Path(file) if file else SAMPLE
    run_id = time.strftime("%Y%m%d%H%M%S")
    _say("payment-worker demo")
    embedded = not (s.database_url and s.redis_url)
    _say(f"[1/6] services ({'embedded, data in ' + str(s.home) if embedded else 'from the URLs'})")
    env_urls = {
        "DATABASE_URL": rt.urls.database,
        "REDIS_URL": rt.urls.redis,
        "CELERY_BROKER_URL": rt.urls.broker,
    }
    for name, url in env_urls.items():
        _say(f"      {name}={mask_url(url)}")
    _say("[2/6] schema: alembic upgrade head")
    migrate.upgrade(rt.urls.sqlalchemy)
    workdir = s.home / "demo" / run_id

    env = {**os.environ, **env_urls, "METRICS_PORT": "0"}
    with LocalCluster(workdir=workdir, env=env) as cluster:
        url = cluster.start_simulator()
        _say(f"[3/6] gateway simulator at {url}")
        for _ in range(workers):
            cluster.start_worker()
        cluster.start_beat()
        _say(f"[4/6] {workers} Celery worker(s) and beat started; logs in {workdir}")
        batches = _load_batches(path, run_id)
        _say(f"[5/6] submitting {len(batches)} batch(es) from {path}")
        ids: list[str] = []
        for b in batches:
            res = submit_batch(b, runtime=rt)
            _say("      " + json.dumps(res.to_json()))
            if res.status != "rejected" and res.batch_id:
                ids.append(res.batch_id)
        total = sum(len(b["items"]) for b in batches)
        deadline = time.monotonic() + timeout
        _say(f"[6/6] processing {total} transaction(s)")
        counts: dict[str, int] = {}
        while time.monotonic() < deadline:
            counts = _progress(rt.engine, ids)
            done = sum(counts.get(k, 0) for k in TERMINAL_TX_STATUSES)
            _say(
                f"      {done}/{total} terminal  "
                + " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            )
            if done >= total:
                break
            time.sleep(1.0)
        with rt.engine.connect() as conn:
            rec = reconcile(conn, cluster.ledger(), ids)
    _say("")
    _say(f"{'batch':<44} {'status':<10} items")
    for batch_id, status, summary in _batch_summaries(rt.engine, ids):
        _say(f"{batch_id:<44} {status:<10} {summary}")
    _say("")
    _say("reconciliation with the gateway ledger: " + json.dumps(rec.summary()))
    if rec.ok:
        _say(
            "every transaction is terminal; none was paid twice; Postgres agrees with the gateway."
        )
        _say("The embedded servers keep running; stop them with: payment-worker services stop")
        return 0
    print("demo: reconciliation failed (see above)", file=sys.stderr)
    return 1
