"""Token requests of one drain whose account's credentials the gateway refuses.

    .venv/bin/python bench/token_refusal.py [--items 200] [--seconds 5] [--latency-ms 0]

One account, one batch of ``--items`` items, the simulator answering every token request
401 ``invalid_client`` (the worker is given a wrong client secret); one drain of
``DRAIN_MAX_SECONDS`` = ``--seconds``, in this process (``run_batch_task``: real Postgres,
Redis and HTTP, no broker). Prints how many token requests the drain sent (the simulator's
own log of the account's requests), per second, the payments sent (must be 0), the item
steps it recorded (claims that ended "not sent") and, where the schema has it, the items
dated by ``transactions.unsent_since``. Run it against another commit's code from a worktree
of it: ``cd WORKTREE && PYTHONPATH=$PWD /path/to/.venv/bin/python /path/to/bench/token_refusal.py``.
Uses DATABASE_URL / REDIS_URL when set, else the embedded servers; a scratch database, Redis
dbs 13 and 14.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
from _env import git_rev, machine, scratch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--seconds", type=float, default=5.0, help="DRAIN_MAX_SECONDS of the drain")
    p.add_argument("--latency-ms", type=float, default=0.0, help="the simulator's latency")
    args = p.parse_args()
    if args.items < 1 or args.seconds <= 0:
        p.error("--items must be at least 1 and --seconds above 0")
    with scratch():
        from payment_worker import runtime
        from payment_worker.dev.local_cluster import LocalCluster
        from payment_worker.dev.samples import make_batches
        from payment_worker.ops.logging import configure_logging
        from payment_worker.producer.submit import submit_batch
        from payment_worker.worker.drain import run_batch_task

        configure_logging("ERROR", json_lines=True)
        with LocalCluster(workdir=Path(tempfile.mkdtemp(prefix="pw-bench-token-"))) as cluster:
            cluster.start_simulator(rate=1000, latency_ms=args.latency_ms)
            sim = cluster.env["GATEWAY_URL"]
            os.environ.update(
                GATEWAY_URL=sim,
                GATEWAY_CLIENT_SECRET="not-the-simulators",  # every token request: 401
                GATEWAY_RATE_PER_SECOND="1000",
                DRAIN_MAX_SECONDS=str(args.seconds),
            )
            runtime.reset()
            [batch] = make_batches(batches=1, items=args.items, accounts=1, prefix="refused")
            assert submit_batch(batch, enqueue=False).status == "accepted"
            account = batch["account_id"]
            started = time.monotonic()
            report = run_batch_task(batch["batch_id"], runtime.current(), account_id=account)
            took = time.monotonic() - started
            log = httpx.get(f"{sim}/_sim/requests", params={"account_id": account}).json()
            ledger = httpx.get(f"{sim}/_sim/ledger").json()
            runtime.reset()
            with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
                has_date = conn.execute(
                    "SELECT count(*) FROM information_schema.columns"
                    " WHERE table_name = 'transactions' AND column_name = 'unsent_since'"
                ).fetchone()
                dated = None
                if has_date and has_date[0]:
                    row = conn.execute(
                        "SELECT count(*) FROM transactions WHERE unsent_since IS NOT NULL"
                    ).fetchone()
                    dated = int(row[0]) if row else 0
    tokens = [r for r in log["requests"] if r[1] == "token"]
    statuses = sorted({str(r[2]) for r in tokens})
    print(f"# token refusal  machine: {machine()}  commit: {git_rev()}")
    print()
    print(
        "| items | drain s | token requests | per second | their statuses | payments sent "
        "| item steps recorded | items dated (unsent_since) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.items} | {took:.2f} | {len(tokens):,} | {len(tokens) / took:,.1f} "
        f"| {', '.join(statuses) or '-'} | {ledger['payments_sent']} | {report.items:,} "
        f"| {'-' if dated is None else f'{dated:,}'} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
