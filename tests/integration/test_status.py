"""``payment-worker status``: the JSON contract, the table, unknown ids, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psycopg

from payment_worker import submit_batch
from tests.conftest import ROOT, PwEnv
from tests.integration.test_producer import make_batch


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ),
    )


def seed(db_conn: psycopg.Connection[Any]) -> None:
    """Two batches; b-1's items moved through the states the worker would write."""
    assert submit_batch(make_batch("b-1", n=3, tx="one"), enqueue=False).status == "accepted"
    assert submit_batch(make_batch("b-2", "acct-2", n=2), enqueue=False).status == "accepted"
    db_conn.execute("UPDATE batches SET status = 'processing' WHERE batch_id = 'b-1'")
    db_conn.execute(
        "UPDATE transactions SET status = 'succeeded', attempts = 1, gateway_payment_id = 'pay-9'"
        " WHERE transaction_id = 'one-0'"
    )
    db_conn.execute(
        "UPDATE transactions SET status = 'failed', attempts = 2,"
        " last_error = 'declined: insufficient_funds' WHERE transaction_id = 'one-2'"
    )


def test_json_for_named_batches(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    seed(db_conn)
    proc = status("b-1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [
        {
            "batch_id": "b-1",
            "account_id": "acct-1",
            "status": "processing",
            "items": [
                {
                    "transaction_id": "one-0",
                    "status": "succeeded",
                    "attempts": 1,
                    "gateway_payment_id": "pay-9",
                    "last_error": None,
                },
                {
                    "transaction_id": "one-1",
                    "status": "pending",
                    "attempts": 0,
                    "gateway_payment_id": None,
                    "last_error": None,
                },
                {
                    "transaction_id": "one-2",
                    "status": "failed",
                    "attempts": 2,
                    "gateway_payment_id": None,
                    "last_error": "declined: insufficient_funds",
                },
            ],
        }
    ]
    both = json.loads(status("b-2", "b-1", "b-1", "--json").stdout)
    assert [b["batch_id"] for b in both] == ["b-1", "b-2"]
    assert [len(b["items"]) for b in both] == [3, 2]


def test_all_as_json_and_empty(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    empty = status("--all", "--json")
    assert empty.returncode == 0 and json.loads(empty.stdout) == []
    seed(db_conn)
    everything = json.loads(status("--all", "--json").stdout)
    assert [(b["batch_id"], b["status"], len(b["items"])) for b in everything] == [
        ("b-1", "processing", 3),
        ("b-2", "pending", 2),
    ]


def test_table_is_readable(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    seed(db_conn)
    proc = status("--all")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        "batch b-1  account acct-1  status processing  items 3  (pending=1 succeeded=1 failed=1)"
    )
    assert lines[1].split() == [
        "TRANSACTION_ID",
        "STATUS",
        "ATTEMPTS",
        "GATEWAY_PAYMENT_ID",
        "LAST_ERROR",
    ]
    assert lines[2].split() == ["one-0", "succeeded", "1", "pay-9", "-"]
    assert lines[4].split()[:4] == ["one-2", "failed", "2", "-"]
    assert lines[4].endswith("declined: insufficient_funds")
    # columns line up: every row of a batch starts its STATUS column at the same place
    col = lines[1].index("STATUS")
    assert all(line[col - 2 : col] == "  " and line[col] != " " for line in lines[2:5])
    assert lines[5] == ""
    assert lines[6].startswith("batch b-2  account acct-2  status pending  items 2")


def test_unknown_batch_exits_1_and_still_prints_the_known(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    seed(db_conn)
    proc = status("b-2", "nope", "--json")
    assert proc.returncode == 1
    assert [b["batch_id"] for b in json.loads(proc.stdout)] == ["b-2"]
    assert proc.stderr.strip() == "payment-worker status: no batch 'nope'"


def test_usage_and_database_errors_are_one_line(pw_env: PwEnv) -> None:
    usage = status()
    assert usage.returncode == 2 and "--all" in usage.stderr
    down = subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", "status", "--all"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"},
    )
    assert down.returncode == 1
    assert down.stderr.startswith("payment-worker status: database error")
    assert "Traceback" not in down.stderr
