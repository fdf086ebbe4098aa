"""``status --all`` over 100,000 items: streamed from a server-side cursor, bounded time and
memory, output written while rows are still coming."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from sqlalchemy import Connection, text

from payment_worker import runtime, submit_batch
from payment_worker.cli import status as status_cli
from payment_worker.db.batches import StatusRow, stream_status
from payment_worker.producer.status import batch_statuses
from tests.conftest import ROOT, PwEnv
from tests.integration.test_producer import make_batch

BATCHES = 10
PER_BATCH = 10_000  # the default MAX_ITEMS_PER_BATCH
ITEMS = BATCHES * PER_BATCH
# generous for a loaded 2-core CI box; a quiet one takes about 2 s
TIME_LIMIT_S = 30.0
# extra peak memory allowed for 100,000 items over a run that prints 1,000 (streamed: about
# 1 MB for JSON, 7 MB for the table, which holds one batch); fetching all rows and building the
# JSON at once was measured at about 250 MB more
MEMORY_LIMIT_KB = 40_000


class Spy(io.StringIO):
    """An output stream that, at the first item written, notes what the reader had pulled
    from the database and whether a server-side cursor was open."""

    def __init__(self, conn: Connection, pulled: list[int]) -> None:
        super().__init__()
        self.conn = conn
        self.pulled = pulled
        self.writes = 0
        self.first: tuple[int, list[str]] | None = None

    def write(self, s: str) -> int:
        self.writes += 1
        if self.first is None and '"transaction_id"' in s:
            # the unnamed portal (name '') is this very query; a named one is a server cursor
            cursors = self.conn.execute(
                text("SELECT statement FROM pg_cursors WHERE name <> ''")
            ).scalars()
            self.first = (self.pulled[0], [str(c) for c in cursors])
        return super().write(s)


def counting(rows: Iterator[StatusRow], pulled: list[int]) -> Iterator[StatusRow]:
    for row in rows:
        pulled[0] += 1
        yield row


# runs the real CLI, then reports its own peak RSS (VmHWM): getrusage()'s ru_maxrss would not
# do, because Linux carries the forking parent's (pytest's) peak across fork and exec
PEAK_RSS_CHILD = r"""
import sys
from payment_worker.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(hwm.split()[1], file=sys.stderr)
sys.exit(rc)
"""


def peak_rss_kb(*args: str) -> tuple[int, float]:
    """Run ``payment-worker status ARGS`` with stdout discarded: (peak RSS in KB, seconds)."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_CHILD, "status", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.split()[-1]), elapsed


def test_all_with_100k_items_is_streamed(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    for b in range(BATCHES):
        data = make_batch(f"big-{b:02d}", f"acct-{b}", n=PER_BATCH, tx=f"b{b}")
        assert submit_batch(data, enqueue=False).status == "accepted"
    assert submit_batch(make_batch("small", "acct-s", n=1_000), enqueue=False).items == 1_000
    assert db_conn.execute("SELECT count(*) FROM transactions").fetchone() == (ITEMS + 1_000,)

    # in process: output starts after one row, while the server-side cursor is still open
    pulled = [0]
    with runtime.current().engine.connect() as conn:
        spy = Spy(conn, pulled)
        started = time.monotonic()
        batches = batch_statuses(counting(stream_status(conn, None), pulled))
        written = status_cli.write_json(batches, spy)
        elapsed = time.monotonic() - started
    assert spy.first is not None
    rows_pulled_at_first_item, open_cursors = spy.first
    assert rows_pulled_at_first_item == 1
    assert len(open_cursors) == 1 and "LEFT JOIN transactions" in open_cursors[0]
    assert pulled[0] == ITEMS + 1_000
    assert spy.writes > ITEMS  # one write per item, not one big string at the end
    assert elapsed < TIME_LIMIT_S
    doc = json.loads(spy.getvalue())
    assert written == [b["batch_id"] for b in doc]
    assert [len(b["items"]) for b in doc] == [PER_BATCH] * BATCHES + [1_000]
    assert doc[3]["items"][17] == {
        "transaction_id": "b3-17",
        "status": "pending",
        "attempts": 0,
        "gateway_payment_id": None,
        "last_error": None,
    }

    # the real command: bounded time, and peak memory that does not grow with the items
    small_kb, _ = peak_rss_kb("small", "--json")
    all_kb, all_s = peak_rss_kb("--all", "--json")
    table_kb, table_s = peak_rss_kb("--all")
    print(
        f"status --all --json: {all_s:.2f} s, peak RSS {all_kb / 1024:.1f} MB; table: "
        f"{table_s:.2f} s, {table_kb / 1024:.1f} MB; one small batch: {small_kb / 1024:.1f} MB"
    )
    assert all_s < TIME_LIMIT_S and table_s < TIME_LIMIT_S
    assert all_kb - small_kb < MEMORY_LIMIT_KB
    assert table_kb - small_kb < MEMORY_LIMIT_KB
