"""20 processes submit the same batch at the same instant: one accepted, one broker message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psycopg

from tests.conftest import ROOT, PwEnv
from tests.integration.test_producer import broker_messages, counts, make_batch

PROCESSES = 20

# each child warms up (imports, database and Redis connections, the Celery producer), says
# "ready", and waits for the go line on stdin so that all submit at once
CHILD = r"""
import json, sys
from prometheus_client import REGISTRY
from payment_worker import submit_batch
from payment_worker import runtime
from payment_worker.worker.celery_app import app

batch = json.loads(sys.argv[1])
with runtime.current().engine.connect():
    pass
runtime.current().dedup_redis.ping()
with app.connection_for_write() as conn:
    conn.ensure_connection()
print("ready", flush=True)
sys.stdin.readline()
result = submit_batch(batch)
layers = {
    layer: REGISTRY.get_sample_value(
        "payment_worker_submit_duplicates_total", {"layer": layer}
    ) or 0
    for layer in ("redis", "postgres")
}
print(json.dumps({"status": result.status, "layers": layers}), flush=True)
"""


def test_twenty_processes_same_batch(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    batch = make_batch("b-burst", n=100)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(batch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ),
        )
        for _ in range(PROCESSES)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    statuses = sorted(o["status"] for o in outputs)
    assert statuses == ["accepted"] + ["duplicate"] * (PROCESSES - 1)
    caught = {layer: sum(o["layers"][layer] for o in outputs) for layer in ("redis", "postgres")}
    assert caught["redis"] + caught["postgres"] == PROCESSES - 1
    print(f"duplicates caught by layer: {caught}")
    assert broker_messages(pw_env) == ["b-burst"]
    assert counts(db_conn) == (1, 100, 100)
