"""A real worker's /metrics with each pool: the threads pool (one process) and prefork (the
tasks run in forked children, merged by prometheus-client's multiprocess mode); a busy
METRICS_PORT ends the worker with one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from payment_worker.dev.local_cluster import LocalCluster, free_port
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import PwEnv, wait_until

TERMINAL = ("succeeded", "failed", "dead")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, by name and sorted labels."""
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def finished(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """payment_worker_transactions_finished_total by status."""
    return {
        st: m.get(("payment_worker_transactions_finished_total", (("status", st),)), -1)
        for st in TERMINAL
    }


def db_finished(conn: psycopg.Connection[Any]) -> dict[str, float]:
    rows = conn.execute("SELECT status, count(*) FROM transactions GROUP BY status").fetchall()
    counts = {str(s): float(n) for s, n in rows}
    return {st: counts.get(st, 0.0) for st in TERMINAL}


def _run(
    pool: str, concurrency: int, pw_env: PwEnv, db_conn: psycopg.Connection[Any], tmp: Path
) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], dict[int, float]]:
    port = free_port()
    env = {**os.environ, "METRICS_PORT": str(port), "TMPDIR": str(tmp), "SWEEPER_INTERVAL": "2"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with LocalCluster(workdir=tmp / "cluster", env=env, pool=pool) as cluster:
        # a little latency: a drain takes long enough that each pool process gets accounts
        # (at zero latency one prefork child could drain all six before the other starts)
        cluster.start_simulator(rate=200, latency_ms=30)
        for b in make_batches(batches=12, items=10, accounts=6, prefix=pool, reject_every=13):
            assert submit_batch(b).status == "accepted"
        worker = cluster.start_worker(concurrency=concurrency)
        wait_until(lambda: sum(db_finished(db_conn).values()) == 120, 90, "120 items terminal")
        # the counters agree with Postgres, the children's summed (a scrape may need a moment
        # after the last commit: the count follows the commit)
        wait_until(lambda: finished(scrape(port)) == db_finished(db_conn), 10, "counters")
        # the last tasks end (a holder waits a moment for more work before it lets go)
        busy = ("payment_worker_batches_in_progress", ())
        wait_until(lambda: scrape(port)[busy] == 0, 20, "no batch in progress")
        m = scrape(port)
        metrics_dir = tmp / f"payment-worker-metrics-{os.getuid()}" / str(worker.pid)
        if pool == "prefork":
            assert metrics_dir.is_dir(), sorted(tmp.rglob("*"))
            per_pid = _finished_per_pid(metrics_dir)
        else:
            # one process: its own registry, no multiprocess files (their one lock per
            # process is what hundreds of task threads would queue on)
            assert not metrics_dir.exists(), sorted(tmp.rglob("*"))
            per_pid = {worker.pid: sum(finished(m).values())}
        worker.stop()
        assert worker.popen is not None and worker.popen.returncode == 0
    # a worker that stops removes the directory it made
    assert not metrics_dir.exists()
    return m, per_pid


def _finished_per_pid(metrics_dir: Path) -> dict[int, float]:
    """Items finished as each process's own counter file holds them."""
    out: dict[int, float] = {}
    for f in metrics_dir.glob("counter_*.db"):
        pid = int(f.stem.rpartition("_")[2])
        for metric in MultiProcessCollector.merge([str(f)]):
            for s in metric.samples:
                if s.name == "payment_worker_transactions_finished_total":
                    out[pid] = out.get(pid, 0) + s.value
    return out


def test_threads_pool_serves_its_counters(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    m, per_pid = _run("threads", 4, pw_env, db_conn, tmp_path)
    assert finished(m) == db_finished(db_conn) and finished(m)["failed"] > 0
    # the label values alerts use exist at 0 from the start
    assert m[("payment_worker_lock_lost_total", (("reason", "stolen"),))] == 0
    assert m[("payment_worker_gateway_unauthorized_total", (("endpoint", "create"),))] == 0
    assert m[("payment_worker_dead_letters_total", (("reason", "task_crashed"),))] == 0
    assert m[("payment_worker_fencing_rejections_total", ())] == 0
    # one process did all the work
    assert list(per_pid.values()) == [120], per_pid


def test_prefork_children_are_summed(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    m, per_pid = _run("prefork", 2, pw_env, db_conn, tmp_path)
    assert finished(m) == db_finished(db_conn)
    # both children finished items, and the page shows their sum
    busy = [n for n in per_pid.values() if n > 0]
    assert len(busy) >= 2, per_pid
    assert sum(busy) == sum(finished(m).values()) == 120


def test_busy_metrics_port_ends_the_worker_with_one_line(pw_env: PwEnv, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "METRICS_PORT": str(port), "TMPDIR": str(tmp_path)}
        argv = [sys.executable, "-m", "celery", "-A", "payment_worker", "worker"]
        argv += ["-P", "threads", "-c", "2", "--without-gossip", "--without-mingle"]
        started = time.monotonic()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    # (Celery's own warning about running as root may come first on a CI machine)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("payment-worker:")]
    assert len(lines) == 1 and proc.stderr.rstrip().endswith(lines[0]), proc.stderr
    assert f"METRICS_PORT={port}" in lines[0] and "Traceback" not in proc.stderr + proc.stdout
    assert time.monotonic() - started < 60
    # nothing left behind for the next start
    assert not list((tmp_path / f"payment-worker-metrics-{os.getuid()}").glob("*/*.db"))
