"""Processing throughput with real Celery workers, the simulator on the same machine.

    .venv/bin/python bench/throughput.py [--scenario 1 2 3] [--pool threads] [--workers 1]
        [--concurrency 32] [--rate 100] [--quick]

Scenarios (issue 5): 1. zero latency, 200 accounts x 1 batch x 50 items; 2. 20 ms latency,
same shape; 3. contention, 20 accounts x 10 batches x 50 items. The simulator's per-account
rate and the client's quota are both ``--rate`` (pacing is measured, not hidden).

Per scenario: items/s (from the first enqueue to the last terminal item), Postgres
transactions per item (pg_stat_database.xact_commit; every statement of the worker is its own
transaction), Redis commands per item (INFO commandstats, app + broker), peak worker RSS,
task executions per batch by result (scraped from the workers' /metrics), and for scenario 2
the bound min(accounts, slots) / latency. Uses DATABASE_URL / REDIS_URL when set, else the
embedded servers; creates and drops a scratch database and flushes Redis dbs 13 and 14.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _env import git_rev, machine, scratch

SCENARIOS: dict[int, dict[str, Any]] = {
    1: {"name": "zero latency", "accounts": 200, "batches": 200, "items": 50, "latency_ms": 0},
    2: {"name": "20 ms latency", "accounts": 200, "batches": 200, "items": 50, "latency_ms": 20},
    3: {"name": "contention", "accounts": 20, "batches": 200, "items": 50, "latency_ms": 0},
}


def _rss_kb(pid: int) -> int:
    total = 0
    pids = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(k) for k in kids]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children (clock ticks to seconds)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    split = os.environ.get("PW_BENCH_CPU")  # "user" or "sys": one of the two only
    idx = {"user": (11, 13), "sys": (12, 14)}.get(split or "")
    if idx is not None:
        return sum(int(fields[i]) for i in idx) / os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _pids_named(fragment: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if fragment in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _cpu_by_component(cluster: Any) -> dict[str, float]:
    workers = [w.pid for w in cluster.workers()]
    sim = [p.pid for p in cluster.processes if p.name == "gateway-sim"]
    return {
        "worker": sum(_cpu_seconds(p) for p in workers),
        "sim": sum(_cpu_seconds(p) for p in sim),
        "postgres": sum(_cpu_seconds(p) for p in _pids_named("postgres")),
        "redis": sum(_cpu_seconds(p) for p in _pids_named("redis-server")),
    }


def _redis_calls(r: Any) -> int:
    stats = r.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def _xacts(conn: Any) -> int:
    row = conn.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database "
        "WHERE datname = current_database()"
    ).fetchone()
    return int(row[0])


def _scrape(port: int) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return out
    for m in re.finditer(r'^payment_worker_task_executions_total\{result="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def run_scenario(num: int, args: argparse.Namespace, urls: tuple[str, str, str]) -> dict[str, Any]:
    import psycopg
    import redis

    from payment_worker import runtime
    from payment_worker.dev.local_cluster import LocalCluster, free_port
    from payment_worker.dev.samples import make_batches
    from payment_worker.producer.submit import submit_batch
    from payment_worker.worker.queueing import enqueue_batch

    sc = dict(SCENARIOS[num])
    if args.quick:
        sc.update(
            accounts=max(sc["accounts"] // 20, 2), batches=max(sc["batches"] // 20, 4), items=10
        )
    db_url, r_app, r_broker = urls
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE dead_letters, idempotency_keys, transactions, batches, "
            "account_fences RESTART IDENTITY CASCADE"
        )
    for url in (r_app, r_broker):
        redis.Redis.from_url(url).flushdb()
    runtime.reset()
    batches = make_batches(
        batches=sc["batches"], items=sc["items"], accounts=sc["accounts"], prefix=f"s{num}"
    )
    for b in batches:
        assert submit_batch(b, enqueue=False).status == "accepted"
    total = sc["batches"] * sc["items"]
    env = {**os.environ, "GATEWAY_RATE_PER_SECOND": str(args.rate), "LOG_LEVEL": "WARNING"}
    workdir = Path(tempfile.mkdtemp(prefix=f"pw-bench-{num}-"))
    r = redis.Redis.from_url(r_app)
    ports: list[int] = []
    with LocalCluster(
        workdir=workdir, env=env, concurrency=args.concurrency, pool=args.pool
    ) as cluster:
        cluster.start_simulator(rate=args.rate, latency_ms=sc["latency_ms"])
        for _ in range(args.workers):
            port = free_port()
            ports.append(port)
            cluster.env["METRICS_PORT"] = str(port)
            cluster.start_worker()
        time.sleep(args.warmup)
        with psycopg.connect(db_url, autocommit=True) as conn:
            x0, c0 = _xacts(conn), _redis_calls(r)
            cpu0 = _cpu_by_component(cluster)
            t0 = time.monotonic()
            for b in batches:
                enqueue_batch(b["batch_id"])
            peak = 0
            polls = 0
            while True:
                polls += 1
                done = conn.execute(
                    "SELECT count(*) FROM transactions WHERE status IN "
                    "('succeeded', 'failed', 'dead')"
                ).fetchone()[0]
                peak = max(peak, sum(_rss_kb(w.pid) for w in cluster.workers()))
                if done >= total:
                    break
                if time.monotonic() - t0 > args.timeout:
                    raise SystemExit(f"scenario {num}: timeout with {done}/{total} done")
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
            c1 = _redis_calls(r)
            cpu1 = _cpu_by_component(cluster)
            time.sleep(1.2)  # PostgreSQL publishes backend statistics at most once a second
            x1 = _xacts(conn) - polls - 1
        execs: dict[str, float] = {}
        for port in ports:
            for k, v in _scrape(port).items():
                execs[k] = execs.get(k, 0.0) + v
        ledger = cluster.ledger()
    slots = args.workers * args.concurrency
    out = {
        "scenario": f"{num}. {sc['name']}",
        "shape": f"{sc['accounts']} acct x {sc['batches'] // sc['accounts']} x {sc['items']}",
        "items": total,
        "seconds": elapsed,
        "items_per_s": total / elapsed,
        "pg_per_item": (x1 - x0) / total,
        "redis_per_item": (c1 - c0) / total,
        "peak_rss_mb": peak / 1024,
        "execs_per_batch": sum(execs.values()) / sc["batches"] if execs else float("nan"),
        "wasted_per_batch": (execs.get("contended", 0) + execs.get("idle", 0)) / sc["batches"]
        if execs
        else float("nan"),
        "double": len(ledger.get("double_payments", [])),
        "http_429": ledger.get("http_429_by_cause", {}),
        # CPU microseconds per item, by process kind (postgres/redis: every such process here)
        "cpu_us": {k: 1e6 * (cpu1[k] - cpu0[k]) / total for k in cpu0},
        "bound": min(sc["accounts"], slots) / (sc["latency_ms"] / 1000)
        if sc["latency_ms"]
        else None,
    }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--pool", default="threads")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--warmup", type=float, default=4.0, help="seconds for workers to start")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="small shapes (CI smoke)")
    args = p.parse_args()
    from payment_worker.ops.logging import configure_logging

    configure_logging("WARNING")
    print(f"# throughput  machine: {machine()}  commit: {git_rev()}")
    print(
        f"# pool={args.pool} workers={args.workers} concurrency={args.concurrency} "
        f"rate={args.rate}/s per account (simulator and client)"
    )
    rows = []
    with scratch() as urls:
        for num in args.scenario:
            rows.append(run_scenario(num, args, urls))
    head = (
        f"| {'scenario':<16} | {'shape':<20} | {'items/s':>8} | {'PG/item':>7} | "
        f"{'Redis/item':>10} | {'peak RSS MB':>11} | {'execs/batch':>11} | "
        f"{'wasted/batch':>12} | {'bound':>7} | {'% bound':>7} | {'double':>6} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        bound = f"{r['bound']:.0f}" if r["bound"] else "-"
        pct = f"{100 * r['items_per_s'] / r['bound']:.0f}%" if r["bound"] else "-"
        print(
            f"| {r['scenario']:<16} | {r['shape']:<20} | {r['items_per_s']:>8.0f} | "
            f"{r['pg_per_item']:>7.2f} | {r['redis_per_item']:>10.1f} | "
            f"{r['peak_rss_mb']:>11.0f} | {r['execs_per_batch']:>11.2f} | "
            f"{r['wasted_per_batch']:>12.2f} | {bound:>7} | {pct:>7} | {r['double']:>6} |"
        )
    print()
    print("429 answers by cause: " + "; ".join(f"{r['scenario']}: {r['http_429']}" for r in rows))
    print(
        "CPU per item (µs): "
        + "; ".join(
            r["scenario"] + ": " + ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us"].items())
            for r in rows
        )
    )
    return 0 if all(r["double"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
