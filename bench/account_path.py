"""CPU of one account's path, single-threaded and outside Celery (issue 13).

    .venv/bin/python bench/account_path.py [--accounts 300] [--items 5] [--profile FILE] [--calls]

Submits ``--accounts`` batches of ``--items`` items, one account each, then calls
``run_batch_task`` for each in this one thread against the simulator at zero latency (real
Postgres, Redis and HTTP; no broker, no worker threads): the CPU seconds per account of the
drain itself, without Celery and without the GIL contention of a loaded worker. Two runs with
different ``--items`` separate the cost per account from the cost per item. It also counts
the SQL statements per account (the drain's and the fencing upsert's), and the Postgres
server's CPU per account (its processes alive at both readings: an autovacuum worker that
came and went is left out). ``--profile``
writes a cProfile of the timed part (``python -m pstats FILE``). ``--calls`` adds a table of
the thread CPU spent in each step of the drain (:data:`STEPS`: the lock, the statements, the
gateway calls, the log lines), inclusive (a step inside another counts in both), per
account. Uses DATABASE_URL /
REDIS_URL when set, else the embedded servers; a scratch database, Redis dbs 13 and 14.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from _env import git_rev, machine, scratch
from throughput import _cpu_seconds, server_pids

WARM = 20  # accounts drained before the clock starts (connections, first tokens, imports)

# the drain's steps --calls times: (module, class, method)
STEPS = [
    ("payment_worker.worker.drain", "Drainer", "run_account"),
    ("payment_worker.locks.account_lock", "AccountLock", "acquire"),
    ("payment_worker.gateway.client", "GatewayClient", "account_start"),
    ("payment_worker.gateway.client", "GatewayClient", "prefetch_token"),
    ("payment_worker.db.work_store", "PgWorkStore", "fence_and_claim"),
    ("payment_worker.db.work_store", "PgWorkStore", "claim_due"),
    ("payment_worker.gateway.client", "GatewayClient", "create_payment"),
    ("payment_worker.gateway.client", "GatewayClient", "lookup_payment"),
    ("payment_worker.gateway.tokens", "TokenManager", "_refresh"),
    ("payment_worker.db.work_store", "PgWorkStore", "record_outcomes"),
    ("payment_worker.db.work_store", "PgWorkStore", "record_and_finish"),
    ("payment_worker.db.work_store", "PgWorkStore", "record_and_claim"),
    ("payment_worker.db.work_store", "PgWorkStore", "complete_and_next_due"),
    ("payment_worker.gateway.client", "GatewayClient", "account_end"),
    ("payment_worker.locks.account_lock", "AccountLock", "release"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--accounts", type=int, default=300)
    p.add_argument("--items", type=int, default=5)
    p.add_argument("--profile", help="write a cProfile of the timed part here")
    p.add_argument("--calls", action="store_true", help="thread CPU per step of the drain")
    p.add_argument(
        "--plans",
        action="store_true",
        help="the prepared statements of the pooled connection, and how often each was planned",
    )
    args = p.parse_args()
    if args.accounts <= WARM or args.items < 1:
        p.error(f"--accounts must exceed {WARM} and --items be at least 1")
    with scratch():
        from payment_worker import runtime
        from payment_worker.dev.local_cluster import LocalCluster
        from payment_worker.dev.samples import make_batches
        from payment_worker.ops.logging import configure_logging
        from payment_worker.producer.submit import submit_batch
        from payment_worker.worker.drain import run_batch_task

        configure_logging("INFO", json_lines=True)
        with LocalCluster(workdir=Path(tempfile.mkdtemp(prefix="pw-bench-path-"))) as cluster:
            cluster.start_simulator(rate=1000, latency_ms=0)
            os.environ.update(
                GATEWAY_URL=cluster.env["GATEWAY_URL"],
                GATEWAY_CLIENT_SECRET=cluster.env["GATEWAY_CLIENT_SECRET"],
                GATEWAY_RATE_PER_SECOND="1000",
            )
            runtime.reset()
            batches = make_batches(
                batches=args.accounts, items=args.items, accounts=args.accounts, prefix="path"
            )
            for b in batches:
                assert submit_batch(b, enqueue=False).status == "accepted"
            rt = runtime.current()
            for b in batches[:WARM]:
                run_batch_task(b["batch_id"], rt, account_id=b["account_id"])
            # SQL statements sent, counted at psycopg's cursor: the drain's (run on the
            # pooled psycopg connection, db/driver.py) and SQLAlchemy's alike
            statements = [0]
            cursor_execute = psycopg.Cursor.execute

            def counted_execute(self: Any, *a: Any, **k: Any) -> Any:
                statements[0] += 1
                return cursor_execute(self, *a, **k)

            psycopg.Cursor.execute = counted_execute  # type: ignore[method-assign]
            # Redis round trips of the drain (the runtime's client: locks, tokens, pacing,
            # marks); a pipeline counts once
            trips = [0]
            client = rt.redis
            command: Callable[..., Any] = client.execute_command
            pipeline = client.pipeline

            def counted_command(*a: Any, **k: Any) -> Any:
                trips[0] += 1
                return command(*a, **k)

            def counted_pipeline(*a: Any, **k: Any) -> Any:
                pipe = pipeline(*a, **k)
                run = pipe.execute

                def execute(*ea: Any, **ek: Any) -> Any:
                    trips[0] += 1
                    return run(*ea, **ek)

                pipe.execute = execute  # type: ignore[method-assign]
                return pipe

            client.execute_command = counted_command  # type: ignore[method-assign]
            client.pipeline = counted_pipeline  # type: ignore[method-assign]
            spent: dict[str, list[float]] = _time_steps() if args.calls else {}
            profiler = cProfile.Profile(time.process_time) if args.profile else None
            pg0 = _server_cpu()
            cpu0, wall0 = time.process_time(), time.monotonic()
            if profiler is not None:
                profiler.enable()
            for b in batches[WARM:]:
                report = run_batch_task(b["batch_id"], rt, account_id=b["account_id"])
                assert report.result == "processed", report
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(args.profile)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            pg = _server_cpu() - pg0
            psycopg.Cursor.execute = cursor_execute  # type: ignore[method-assign]
            plans = _prepared_plans(rt.engine) if args.plans else []
            runtime.reset()  # the pool's backends end, and their table statistics are sent
            tables = _table_stats(os.environ["DATABASE_URL"])
    n = args.accounts - WARM
    print(f"# account path  machine: {machine()}  commit: {git_rev()}")
    print()
    print(
        "| accounts | items each | CPU ms per account | wall ms per account "
        "| SQL statements per account | Redis round trips per account "
        "| Postgres CPU ms per account | profiled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {n} | {args.items} | {1000 * cpu / n:.2f} | {1000 * wall / n:.2f} "
        f"| {statements[0] / n:.2f} | {trips[0] / n:.2f} | {1000 * pg / n:.2f} "
        f"| {'yes' if args.profile else 'no'} |"
    )
    print()
    print(
        "| table | rows | updates per row | heap-only updates | heap bytes per row "
        "| index bytes per row |"
    )
    print("|---|---|---|---|---|---|")
    for name, rows, upd, hot, heap, index in tables:
        print(
            f"| {name} | {rows:,} | {upd / max(rows, 1):.2f} | {hot / max(upd, 1):.0%} "
            f"| {heap / max(rows, 1):,.0f} | {index / max(rows, 1):,.0f} |"
        )
    if spent:
        print()
        print("| step (inclusive) | µs of thread CPU per account | calls per account |")
        print("|---|---|---|")
        for name, (seconds, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
            if calls:
                print(f"| {name} | {1e6 * seconds / n:,.0f} | {calls / n:.2f} |")
    if args.plans:
        print()
        print("| prepared statement (the pooled connection's) | generic plans | custom plans |")
        print("|---|---|---|")
        for text, generic, custom in plans:
            print(f"| `{text}` | {generic:,} | {custom:,} |")
    return 0


def _prepared_plans(engine: Any) -> list[tuple[str, int, int]]:
    """The prepared statements of the connection the drains used (one thread: the pool's
    one connection), each by its first words, with how many times Postgres planned it
    generically and for its parameters (``pg_prepared_statements``, Postgres 14+)."""
    from payment_worker.db.driver import checked_out

    with checked_out(engine) as conn:
        rows = conn.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            " ORDER BY generic_plans + custom_plans DESC"
        ).fetchall()
    return [(" ".join(str(r[0]).split())[:60], int(r[1]), int(r[2])) for r in rows]


def _time_steps() -> dict[str, list[float]]:
    """Wrap each of :data:`STEPS` (and the drain's log calls) to add up its thread CPU and
    calls: {name: [seconds, calls]}, filled as the drains run."""
    import importlib

    spent: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        tally = spent.setdefault(name, [0.0, 0])

        def run(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                tally[0] += time.thread_time() - t0
                tally[1] += 1

        return run

    for module, cls_name, method in STEPS:
        cls = getattr(importlib.import_module(module), cls_name)
        setattr(cls, method, timed(f"{cls_name}.{method}", getattr(cls, method)))
    drain = importlib.import_module("payment_worker.worker.drain")
    logger = drain.log

    class TimedLog:
        def __getattr__(self, level: str) -> Any:
            return timed(f"log.{level} (the drain's lines)", getattr(logger, level))

    setattr(drain, "log", TimedLog())  # noqa: B010 (a module attribute mypy cannot see)
    return spent


def _table_stats(url: str) -> list[tuple[str, int, int, int, int, int]]:
    """Per table of the drain's writes: rows, updates, heap-only updates (no index entry
    written), heap and index bytes, read once every backend that wrote has ended."""
    import psycopg

    out = []
    with psycopg.connect(url, autocommit=True) as conn:
        for name in ("transactions", "idempotency_keys"):
            for _ in range(50):  # an ended backend's statistics arrive a moment later
                row = conn.execute(
                    "SELECT n_live_tup + n_dead_tup, n_tup_upd, n_tup_hot_upd,"
                    " pg_relation_size(relid), pg_indexes_size(relid)"
                    " FROM pg_stat_user_tables WHERE relname = %s",
                    (name,),
                ).fetchone()
                conn.execute("SELECT pg_stat_clear_snapshot()")
                if row and row[1]:
                    break
                time.sleep(0.1)
            assert row is not None
            [rows] = conn.execute(f"SELECT count(*) FROM {name}").fetchone() or [0]
            out.append((name, int(rows), int(row[1]), int(row[2]), int(row[3]), int(row[4])))
    return out


def _server_cpu() -> float:
    """CPU seconds so far of the Postgres server's processes (a backend gone is left out);
    the URLs are the scratch ones ``scratch()`` put in the environment."""
    pids = server_pids(os.environ["DATABASE_URL"], os.environ["REDIS_URL"])["postgres"]
    return sum(_cpu_seconds(p) for p in pids)


if __name__ == "__main__":
    raise SystemExit(main())
