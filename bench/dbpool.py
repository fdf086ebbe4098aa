"""DB_POOL_SIZE against throughput: real workers, threads at high concurrency, the simulator.

    .venv/bin/python bench/dbpool.py [--pool-sizes 2 5 10 20] [--latency-ms 100]
        [--workers 2] [--concurrency 50] [--accounts 200] [--items 10] [--rate 100]

For each pool size: a scratch database, the workers (``celery -A payment_worker worker -P
threads -c N`` with ``DB_POOL_SIZE``), the items submitted, then items/s over the processing
window (first to last terminal write, from Postgres), the most backends any one worker had at
once (``pg_stat_activity`` by ``application_name``, sampled every 20 ms), the most accounts
with a chunk in flight at once, and double payments from the simulator's ledger. Uses
DATABASE_URL / REDIS_URL when set, else the embedded servers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _env import git_rev, machine, scratch, with_path


def _sample(
    admin: str, db: str, pids: list[int], stop: threading.Event, out: dict[str, int]
) -> None:
    import psycopg

    with psycopg.connect(admin, autocommit=True) as a, psycopg.connect(db, autocommit=True) as d:
        while not stop.wait(0.02):
            for pid in pids:
                row = a.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                    (f"payment-worker:{pid}@%",),
                ).fetchone()
                out["backends"] = max(out["backends"], int(row[0]) if row else 0)
            row = d.execute(
                "SELECT count(DISTINCT account_id) FROM transactions WHERE status = 'dispatching'"
            ).fetchone()
            out["in_flight"] = max(out["in_flight"], int(row[0]) if row else 0)


def run_one(pool_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import os

    import psycopg

    from payment_worker.dev.local_cluster import LocalCluster
    from payment_worker.dev.samples import make_batches
    from payment_worker.producer.submit import submit_batch

    with scratch() as (db, _r, _b), tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "METRICS_PORT": "0",
            "DB_POOL_SIZE": str(pool_size),
            "GATEWAY_RATE_PER_SECOND": str(args.rate),
        }
        total = args.accounts * args.items
        with LocalCluster(workdir=Path(tmp), env=env, concurrency=args.concurrency) as cluster:
            cluster.start_simulator(rate=args.rate, latency_ms=args.latency_ms)
            for b in make_batches(
                batches=args.accounts, items=args.items, accounts=args.accounts, prefix="dbp"
            ):
                submit_batch(b)
            workers = [cluster.start_worker() for _ in range(args.workers)]
            peak = {"backends": 0, "in_flight": 0}
            stop = threading.Event()
            admin = with_path(db, "/postgres")
            sampler = threading.Thread(
                target=_sample, args=(admin, db, [w.pid for w in workers], stop, peak)
            )
            sampler.start()
            deadline = time.monotonic() + 170
            with psycopg.connect(db, autocommit=True) as conn:
                while time.monotonic() < deadline:
                    row = conn.execute(
                        "SELECT count(*) FILTER (WHERE status IN ('succeeded','failed','dead')),"
                        " extract(epoch FROM max(updated_at) - min(updated_at))"
                        " FROM transactions"
                    ).fetchone()
                    assert row is not None
                    if row[0] >= total:
                        break
                    time.sleep(0.2)
            stop.set()
            sampler.join()
            ledger = cluster.ledger()
        assert row is not None
        done, window = int(row[0]), float(row[1] or 0.0)
    return {
        "pool": pool_size,
        "done": done,
        "items_s": done / window if window else 0.0,
        "backends": peak["backends"],
        "in_flight": peak["in_flight"],
        "double": len(ledger["double_payments"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool-sizes", type=int, nargs="+", default=[2, 5, 10, 20])
    p.add_argument("--latency-ms", type=float, default=100.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--accounts", type=int, default=200)
    p.add_argument("--items", type=int, default=10)
    p.add_argument("--rate", type=float, default=100.0)
    args = p.parse_args()
    print(f"# {machine()}, commit {git_rev()}")
    print(
        f"# {args.workers} worker(s) x threads {args.concurrency}, {args.accounts} accounts x"
        f" {args.items} items, latency {args.latency_ms:g} ms, rate {args.rate:g}/s per account"
    )
    print("| DB_POOL_SIZE | items/s | max backends per worker | max accounts in flight |", end="")
    print(" double payments |")
    print("|---|---|---|---|---|")
    for size in args.pool_sizes:
        r = run_one(size, args)
        print(
            f"| {r['pool']} | {r['items_s']:.0f} | {r['backends']} | {r['in_flight']} |"
            f" {r['double']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
