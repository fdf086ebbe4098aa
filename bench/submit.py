"""Benchmark of the producer: ``submit_batch`` throughput, and the dedup paths.

    PAYMENT_WORKER_HOME=/tmp/pw-bench .venv/bin/python bench/submit.py [--batches 1000]
        [--items 100] [--procs 1 2] [--redis-dbs 14,15]

Runs against DATABASE_URL / REDIS_URL when set, else the embedded servers. It creates a
fresh database ``pw_bench_<pid>`` on that server (dropped at the end) and FLUSHES the two
Redis database numbers of ``--redis-dbs`` (application, broker). Phases, per process count:

1. accept: every batch is new: validate, insert (one transaction), publish to the broker;
2. dup-redis: the same batches again, inside the Redis dedup window;
3. dup-postgres: again, with the window flushed, so Postgres answers.

Prints one table row per phase; the numbers go to docs/benchmarks-submit.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_batch(run: str, n: int, items: int) -> dict[str, Any]:
    """Batch ``n`` of a run: ``items`` items, 20 accounts round-robin."""
    return {
        "batch_id": f"{run}-batch-{n:06d}",
        "account_id": f"acct-{n % 20:03d}",
        "items": [
            {
                "transaction_id": f"{run}-tx-{n:06d}-{i:05d}",
                "amount": 150_000 + i,
                "currency": "IDR",
                "beneficiary": {
                    "bank_code": "014",
                    "account_number": f"{n:06d}{i:04d}",
                    "name": "Budi Santoso",
                },
                "description": f"payout {n}/{i}",
            }
            for i in range(items)
        ],
    }


def _worker(run: str, indexes: list[int], items: int, phase: str, start: Any, out: Any) -> None:
    from payment_worker import runtime, submit_batch
    from payment_worker.ops.logging import configure_logging
    from payment_worker.worker.tasks import process_account_batch

    configure_logging("WARNING")  # a log line per batch would be measured too
    batches = [make_batch(run, n, items) for n in indexes]
    # connections made before the clock starts: database, broker
    with runtime.current().engine.connect():
        pass
    with process_account_batch.app.connection_for_write() as conn:
        conn.ensure_connection()
    expected = "accepted" if phase == "accept" else "duplicate"
    start.wait()
    latencies = []
    for b in batches:
        t = time.perf_counter()
        status = submit_batch(b).status
        latencies.append(time.perf_counter() - t)
        if status != expected:
            raise SystemExit(f"{b['batch_id']}: {status}, expected {expected}")
    out.put(latencies)


def run_phase(run: str, batches: int, items: int, procs: int, phase: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(procs + 1)
    out: Any = ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(run, list(range(p, batches, procs)), items, phase, start, out),
        )
        for p in range(procs)
    ]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    latencies: list[float] = []
    for _ in workers:
        latencies.extend(out.get())
    wall = time.perf_counter() - t0
    for w in workers:
        w.join()
        if w.exitcode != 0:
            raise SystemExit(f"a worker failed in phase {phase}")
    latencies.sort()
    return {
        "wall": wall,
        "batches_s": batches / wall,
        "items_s": batches * items / wall,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


def _with_path(url: str, path: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=path))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--redis-dbs", default="14,15", help="app,broker db numbers (FLUSHED)")
    args = ap.parse_args()

    import psycopg
    import redis

    from payment_worker.db import migrate
    from payment_worker.runtime import ServiceUrls
    from payment_worker.settings import Settings

    base = ServiceUrls.resolve(Settings())
    admin = _with_path(base.database, "/postgres")
    db_name = f"pw_bench_{os.getpid()}"
    app_db, broker_db = (int(x) for x in args.redis_dbs.split(","))
    r_base = base.redis
    os.environ["DATABASE_URL"] = _with_path(base.database, f"/{db_name}")
    os.environ["REDIS_URL"] = _with_path(r_base, f"/{app_db}")
    os.environ["CELERY_BROKER_URL"] = _with_path(r_base, f"/{broker_db}")
    app_r = redis.Redis.from_url(os.environ["REDIS_URL"])
    broker_r = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
        sync = conn.execute("SHOW synchronous_commit").fetchone()
        fsync = conn.execute("SHOW fsync").fetchone()
    try:
        migrate.upgrade(
            os.environ["DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://")
        )
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        print(f"machine: {os.cpu_count()} CPUs, {cpu}; Python {platform.python_version()}")
        print(f"postgres: synchronous_commit={sync and sync[0]}, fsync={fsync and fsync[0]}")
        print(f"load average at start: {os.getloadavg()}")
        print(f"{args.batches} batches x {args.items} items per phase\n")
        print(
            f"{'procs':>5} {'phase':<13} {'wall s':>8} {'batches/s':>10} {'items/s':>10}"
            f" {'p50 ms':>8} {'p99 ms':>8}"
        )
        for procs in args.procs:
            app_r.flushdb()
            broker_r.flushdb()
            run = f"p{procs}-{os.getpid()}"
            for phase in ("accept", "dup-redis", "dup-postgres"):
                if phase == "dup-postgres":
                    app_r.flushdb()  # close the Redis window: Postgres must answer
                res = run_phase(run, args.batches, args.items, procs, phase)
                print(
                    f"{procs:>5} {phase:<13} {res['wall']:>8.2f} {res['batches_s']:>10.0f}"
                    f" {res['items_s']:>10.0f} {res['p50_ms']:>8.2f} {res['p99_ms']:>8.2f}",
                    flush=True,
                )
            queued = broker_r.llen("payments")
            if queued != args.batches:
                print(f"!! broker holds {queued} messages, expected {args.batches}")
        print(f"\nload average at end: {os.getloadavg()}")
    finally:
        app_r.flushdb()
        broker_r.flushdb()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
