"""The sweeper's first query behind a backlog: wall time and Postgres CPU per pass (issue 13).

    .venv/bin/python bench/sweeper.py                          # 10k, 100k and 1M due items
    .venv/bin/python bench/sweeper.py --items 1000000 --accounts 20000 --rounds 5
    bench/interleaved.sh OLD_REV 1 -- bench/sweeper.py         # against older code

A scratch database (bench/_env.py) holds a backlog of pending items, every one due and
untouched for an hour, in one batch per account. Each round runs the query as the sweeper
does (``stalls.stalled_accounts``, in its own transaction, at most ``SWEEP_LIMIT`` accounts
kept) and reads the CPU of every Postgres process around it, its parallel workers included
(they are reaped by the postmaster, whose children's CPU is counted). The last column is
the share of one Postgres core the sweeper would take at one pass per ``SWEEPER_INTERVAL``
(1 s), with the rest after a long pass that the code in use applies (none before it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from _env import git_rev, machine, scratch


def _postgres_cpu() -> float:
    """utime + stime (and the reaped children's) of every postgres process, seconds."""
    pids = subprocess.run(["pgrep", "postgres"], capture_output=True, text=True).stdout.split()
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _fill(db: str, items: int, accounts: int) -> None:
    import psycopg

    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO batches (batch_id, account_id, fingerprint, item_count)"
            " SELECT 'b-' || a, 'acct-' || a, 'f', 1 FROM generate_series(1, %s) a",
            (accounts,),
        )
        conn.execute(
            "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,"
            " beneficiary, idempotency_key, created_at, updated_at, next_attempt_at)"
            " SELECT b.id, b.account_id, 'tx-' || i, 100, 'EUR', '{}'::jsonb, 'k-' || i,"
            " now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour'"
            " FROM generate_series(1, %s) i JOIN batches b ON b.id = 1 + (i %% %s)",
            (items, accounts),
        )
        conn.execute("ANALYZE")


def _rest_factor() -> float:
    try:
        from payment_worker.worker.sweeper import REST_PER_PASS_SECOND
    except ImportError:  # code before the rest rule: passes back to back
        return 0.0
    return float(REST_PER_PASS_SECOND)


def measure(items: int, accounts: int, rounds: int) -> dict[str, float]:
    """Median wall and Postgres CPU seconds per pass over such a backlog."""
    from sqlalchemy import create_engine

    from payment_worker.db import stalls
    from payment_worker.worker.sweeper import SWEEP_LIMIT

    walls, cpus = [], []
    with scratch() as (db, _r, _b):
        _fill(db, items, accounts)
        engine = create_engine(db.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            for _ in range(rounds):
                with engine.connect() as conn:
                    cpu, started = _postgres_cpu(), time.monotonic()
                    stalls.stalled_accounts(conn, 2.0, SWEEP_LIMIT)
                    walls.append(time.monotonic() - started)
                    conn.rollback()
                time.sleep(0.3)  # parallel workers exit and are reaped
                cpus.append(_postgres_cpu() - cpu)
        finally:
            engine.dispose()
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--accounts", type=int, nargs="+", default=[2_000, 10_000, 20_000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if len(args.items) != len(args.accounts):
        parser.error("--items and --accounts need as many values each")
    rest = _rest_factor()
    rows = [
        (i, a, measure(i, a, args.rounds)) for i, a in zip(args.items, args.accounts, strict=True)
    ]
    print(f"# sweeper query  machine: {machine()}  commit: {git_rev()}")
    print(f"# medians of {args.rounds} passes; rest after a long pass: {rest:g} x its length\n")
    print(
        "| due items | accounts | wall ms per pass | Postgres CPU ms per pass | CPU share at 1 s |"
    )
    print("|---|---|---|---|---|")
    for items, accounts, m in rows:
        period = max(1.0, m["wall"] * (1 + rest))  # the next pass starts after the rest
        print(
            f"| {items:,} | {accounts:,} | {m['wall'] * 1000:,.0f} | {m['cpu'] * 1000:,.0f}"
            f" | {m['cpu'] / period:.0%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
