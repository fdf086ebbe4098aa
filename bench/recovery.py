"""How long each fault stalls the accounts it touches, with real workers (issue 15).

    .venv/bin/python bench/recovery.py [--accounts 16] [--workers 2] [--concurrency 24]
        [--rate 10] [--baseline 15] [--logs DIR]
    .venv/bin/python bench/recovery.py --cost [--held 5000]

Faults, one after the other, on a cluster kept busy by a backlog (every account has work
for the whole run; each worker alone has a slot for every account, so an account taken from
a dead worker never waits for a slot: the stall measured is recovery, not capacity):

* SIGKILL of the worker holding the most accounts (a replacement is started);
* SIGSTOP of that worker past the lock TTL (``LOCK_TTL_MS`` 10 s here, so the run stays
  short; recovery does not depend on it), then SIGCONT;
* FLUSHDB of the application Redis database (locks, liveness keys, marks, tokens);
* FLUSHDB of the broker's database, with a few fresh accounts whose only message it took;
* every database connection of the run terminated (``pg_terminate_backend``: the same
  AdminShutdown, SQLSTATE 57P01, that a fast restart of Postgres raises; a stand-in for the
  restart, which would also cut this script's own connections);
* a rolling restart: each worker in turn gets a replacement, then SIGTERM.

For each, the stall of every affected account: its longest silence in the 10 s after the
fault (from the fault to its next gateway request, or between two of its requests: an old
holder that sends on for a moment before it notices does not hide the hand-over), from the
simulator's request log (``GET /_sim/requests?since=``); p50, p99 (nearest rank) and max, as
a markdown table. Also items/s over a fault-free window and over the fault
window of the same run. ``--cost`` measures the Redis commands that liveness and the sweeper
add with thousands of held accounts (INFO commandstats). Uses DATABASE_URL / REDIS_URL when
set, else the embedded servers; creates and drops a scratch database, flushes Redis dbs 13, 14.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _env import git_rev, machine, scratch

OPEN = "('pending', 'retryable', 'dispatching', 'unknown')"
LOCK_TTL_MS = 10_000


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _slowest(stalls: dict[str, float | None]) -> str:
    return max((s, a) for a, s in stalls.items() if s is not None)[1]


def _terminal(db: Any) -> int:
    row = db.execute(
        "SELECT count(*) FROM transactions WHERE status IN ('succeeded', 'failed', 'dead')"
    ).fetchone()
    return int(row[0])


def run_faults(args: argparse.Namespace) -> None:
    # what else ran on the machine, as the run began (this bench once said "shared" always)
    load_before = os.getloadavg()[0]
    import psycopg
    import redis

    from payment_worker import runtime
    from payment_worker.dev import faults
    from payment_worker.dev.local_cluster import LocalCluster
    from payment_worker.dev.samples import make_batches
    from payment_worker.producer.submit import submit_batch

    with scratch() as (db_url, r_app, r_broker), tempfile.TemporaryDirectory() as scratch_dir:
        tmp = args.logs or scratch_dir
        db = psycopg.connect(db_url, autocommit=True)

        def has_work(account: str) -> bool:
            row = db.execute(
                f"SELECT count(*) FROM transactions WHERE account_id = %s AND status IN {OPEN}",
                (account,),
            ).fetchone()
            return bool(row and row[0])

        def terminate() -> int:
            return len(
                db.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchall()
            )

        env = {
            **os.environ,
            "METRICS_PORT": "0",
            "LOCK_TTL_MS": str(LOCK_TTL_MS),
            "GATEWAY_RATE_PER_SECOND": str(args.rate),
            "GATEWAY_READ_TIMEOUT": "2",
        }
        results: list[faults.Fault] = []
        with LocalCluster(workdir=Path(tmp), env=env, concurrency=args.concurrency) as cluster:
            cluster.start_simulator(rate=args.rate, seed=5)
            os.environ["GATEWAY_URL"] = cluster.env["GATEWAY_URL"]
            runtime.reset()
            # enough work for every account to stay busy through the whole run
            per_account = int(args.rate * 140)
            batches = make_batches(
                batches=args.accounts * (per_account // 100),
                items=100,
                accounts=args.accounts,
                prefix="rb",
            )
            t = time.monotonic()
            for b in batches:
                assert submit_batch(b).status == "accepted"
            print(f"submitted {len(batches) * 100} items in {time.monotonic() - t:.1f}s")
            started = [cluster.start_worker() for _ in range(args.workers)]
            target = faults.FaultTarget(
                cluster=cluster,
                app=redis.Redis.from_url(r_app),
                broker=redis.Redis.from_url(r_broker),
                accounts=[f"acct-{a:04d}" for a in range(args.accounts)],
                has_work=has_work,
            )
            for worker in started:
                faults.wait_alive(target, worker)
            faults.wait_for_holder(target, 60)
            time.sleep(5)  # every worker up and draining: the baseline is steady state
            t0, n0 = time.monotonic(), _terminal(db)
            time.sleep(args.baseline)
            t1, n1 = time.monotonic(), _terminal(db)
            window = 10.0  # each fault: every affected account's longest silence in it

            def settle() -> None:
                time.sleep(1)

            fault = faults.kill_holder(target)
            cluster.start_worker()
            results.append(faults.measure(target, fault, window))
            settle()

            fault, paused = faults.pause_holder(target)
            # woken past the lock TTL, inside the window: it must find itself overtaken
            waker = threading.Timer(LOCK_TTL_MS / 1000 + 1, paused.resume)
            waker.start()
            results.append(faults.measure(target, fault, window))
            waker.join()
            settle()

            results.append(faults.measure(target, faults.flush_lock_store(target), window))
            settle()

            lost = [f"acct-lost-{i}" for i in range(4)]
            for i, acct in enumerate(lost):
                [b] = make_batches(batches=1, items=50, accounts=1, prefix=f"rb-lost-{i}")
                b["account_id"] = acct
                assert submit_batch(b, enqueue=False).status == "accepted"
            target.accounts = [*target.accounts, *lost]
            results.append(faults.measure(target, faults.flush_broker(target, lost), window))
            settle()

            results.append(faults.measure(target, faults.cut_database(target, terminate), window))
            settle()

            rolling = faults.Fault("SIGTERM (rolling restart)", 0.0, [])
            for old in list(cluster.workers()):
                faults.wait_alive(target, cluster.start_worker())
                fault = faults.measure(target, faults.terminate_holder(target, old), window)
                rolling.stalls.update({f"{a}#{old.name}": s for a, s in fault.stalls.items()})
                if old.popen is not None:
                    old.popen.wait(30)
                settle()
            rolling.affected = sorted(rolling.stalls)
            results.append(rolling)
            t2, n2 = time.monotonic(), _terminal(db)
            ledger = cluster.ledger()
        db.close()

    if args.logs:
        import json

        stalls = {f.kind: f.stalls for f in results}
        (Path(args.logs) / "stalls.json").write_text(json.dumps(stalls, indent=1))
    print()
    print(
        f"machine: {machine()} (1-minute load average {load_before:.2f} as the run began), "
        f"commit {git_rev()}"
    )
    print(
        f"workers {args.workers} x threads {args.concurrency}, {args.accounts} accounts at "
        f"{args.rate} requests/s each, LOCK_TTL_MS {LOCK_TTL_MS}, liveness and sweeper defaults"
    )
    print()
    print("| fault | affected accounts | p50 s | p99 s | max s (account) | not resumed in 10 s |")
    print("|---|---|---|---|---|---|")
    for f in results:
        done = [s for s in f.stalls.values() if s is not None]
        missing = sum(1 for s in f.stalls.values() if s is None)
        if done:
            print(
                f"| {f.kind} | {len(f.stalls)} | {_pct(done, 0.5):.2f} | {_pct(done, 0.99):.2f}"
                f" | {max(done):.2f} ({_slowest(f.stalls)}) | {missing} |"
            )
        else:
            print(f"| {f.kind} | {len(f.stalls)} | - | - | - | {missing} |")
    base = (n1 - n0) / (t1 - t0)
    with_faults = (n2 - n1) / (t2 - t1)
    print()
    print(
        f"items/s without faults: {base:.1f} ({t1 - t0:.0f} s); with faults: {with_faults:.1f}"
        f" ({t2 - t1:.0f} s, {len(results)} fault kinds); ratio {with_faults / base:.2f}"
    )
    print(f"double payments: {len(ledger['double_payments'])}")
    # a takeover after a kill or a pause must not crowd the account past its quota
    print(f"429 answers by cause: {ledger.get('http_429_by_cause', {})}")


def run_cost(args: argparse.Namespace) -> None:
    """Redis commands added by liveness and the sweeper with ``--held`` held accounts."""
    import psycopg
    import redis

    from payment_worker import runtime
    from payment_worker.locks.liveness import lock_value
    from payment_worker.producer.submit import submit_batch
    from payment_worker.worker.sweeper import run_sweep

    def calls(r: redis.Redis) -> dict[str, int]:
        stats = r.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}

    def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}

    def submit(rt: runtime.Runtime, n: int, enqueue: bool) -> None:
        t = time.monotonic()
        for i in range(n):
            batch = {
                "batch_id": f"cost-{i}",
                "account_id": f"acct-{i:05d}",
                "items": [
                    {
                        "transaction_id": f"cost-{i}",
                        "amount": 1000,
                        "currency": "IDR",
                        "beneficiary": {
                            "bank_code": "014",
                            "account_number": "1234567890",
                            "name": "Budi",
                        },
                    }
                ],
            }
            assert submit_batch(batch, runtime=rt, enqueue=enqueue).status == "accepted"
        print(f"submitted {n} accounts in {time.monotonic() - t:.1f}s")

    n = args.held
    # a backlog: n accounts whose messages all wait in the queue, free, untouched for longer
    # than SWEEPER_STALE_AFTER (each cost 3 GETs per pass before the stale period grew by the
    # backlog's wait)
    with scratch() as (_, r_app, _):
        rt = runtime.current()
        r = redis.Redis.from_url(r_app)
        submit(rt, n, enqueue=True)
        time.sleep(rt.settings.sweeper_stale_after + 1.0)
        before = calls(r)
        t = time.monotonic()
        waiting = run_sweep(rt)
        waiting_took = time.monotonic() - t
        backlog = delta(before, calls(r))
    with scratch() as (db_url, r_app, _):
        rt = runtime.current()
        r = redis.Redis.from_url(r_app)
        submit(rt, n, enqueue=False)
        with psycopg.connect(db_url, autocommit=True) as db:
            db.execute("UPDATE transactions SET updated_at = now() - interval '1 minute'")
        # every account held by one of 4 live processes (their liveness keys exist)
        holders = [f"bench-{p}-0000000{p}" for p in range(4)]
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.set(rt.keys.lock(f"acct-{i:05d}"), lock_value(holders[i % 4], "ab" * 16))
        for h in holders:
            pipe.set(rt.keys.alive(h), 1)
        pipe.execute()
        before = calls(r)
        t = time.monotonic()
        summary = run_sweep(rt)
        took = time.monotonic() - t
        sweep = delta(before, calls(r))
        # one process's heartbeat for 5 s
        rt.liveness.start()
        before = calls(r)
        time.sleep(5)
        beats = delta(before, calls(r))
        rt.liveness.stop()
    interval = rt.settings.sweeper_interval
    per_pass = sum(sweep.values())
    print()
    print(f"machine: {machine()} (shared), commit {git_rev()}")
    print()
    print("| what | Redis commands | per second |")
    print("|---|---|---|")
    print(
        f"| one sweeper pass, {n} stale accounts all held by 4 live processes "
        f"({summary['busy']} busy, {took * 1000:.0f} ms) | {per_pass} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(sweep.items()))}) "
        f"| {per_pass / interval:.0f} (one pass per SWEEPER_INTERVAL {interval:g} s, fleet-wide) |"
    )
    per_backlog = sum(backlog.values())
    print(
        f"| one sweeper pass, {n} free accounts whose messages wait in the queue "
        f"({waiting['queued']} judged waiting, {len(waiting['reenqueued'])} re-enqueued, "
        f"{waiting_took * 1000:.0f} ms) | {per_backlog} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(backlog.items()))}) "
        f"| {per_backlog / interval:.0f} |"
    )
    print(
        f"| one process's heartbeat, 5 s | {sum(beats.values())} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(beats.items()))}) "
        f"| {sum(beats.values()) / 5:.1f} per process, whatever it holds |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accounts", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--baseline", type=float, default=15.0)
    parser.add_argument("--cost", action="store_true", help="measure Redis cost instead")
    parser.add_argument("--held", type=int, default=5000)
    parser.add_argument("--logs", help="keep the workers' and simulator's logs in this folder")
    args = parser.parse_args()
    if args.cost:
        run_cost(args)
    else:
        run_faults(args)


if __name__ == "__main__":
    main()
