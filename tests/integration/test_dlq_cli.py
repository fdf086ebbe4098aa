"""The dlq commands as on-call types them (subprocesses), on dead items made by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import PwEnv
from tests.integration.test_dead_letters_db import _dead, _status

ROOT = Path(__file__).resolve().parents[2]


def run(
    *args: str, stdin: str | None = None, via: str = "celery"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "USER": "oncall-test"}
    cmd = (
        [sys.executable, "-m", "celery", "-A", "payment_worker", "dlq", *args]
        if via == "celery"
        else [sys.executable, "-m", "payment_worker.cli", "dlq", *args]
    )
    return subprocess.run(
        cmd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def test_list_and_show(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    a = _dead(db_conn, "l1", "retries_exhausted", None)
    b = _dead(db_conn, "l2", "in_doubt_key_expired", 10**6)
    out = run("list")
    assert out.returncode == 0, out.stderr
    assert "******7890" in out.stdout and "1234567890" not in out.stdout
    assert "in_doubt_key_expired=1, retries_exhausted=1" in out.stdout
    rows = json.loads(run("list", "--json", "--reason", "retries_exhausted").stdout)
    assert [r["id"] for r in rows] == [a]
    rows = json.loads(run("list", "--json", "--since", "1h", via="pw").stdout)
    assert sorted(r["id"] for r in rows) == [a, b]
    shown = json.loads(run("show", str(b), "--json").stdout)
    assert shown["replay_would"].endswith("will not resend: key retention passed, resolve by hand")
    text = run("show", str(a)).stdout
    assert "look up, then send if the gateway never applied it" in text


@pytest.mark.parametrize(
    "args",
    [
        ("show", "999"),
        ("list", "--reason", "nope"),
        ("list", "--since", "yesterday"),
        ("list", "--status", "weird"),
        ("replay", "999"),
        ("resolve", "1", "--note", "x"),
        ("resolve", "1", "--as", "maybe", "--note", "x"),
        ("replay",),
        # digits int() refuses, an id past bigint, a span past Postgres's intervals: each
        # was a traceback or a "database error" (exit 1) before
        ("show", "\u00b2"),
        ("replay", "\u0663"),
        ("show", "9" * 30),
        ("list", "--since", "999999999999w"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], args: tuple[str, ...]
) -> None:
    _dead(db_conn, "bad", "retries_exhausted", None)
    out = run(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert _status(db_conn, "bad") == ("dead", 8)


def test_replaying_an_item_that_is_not_dead_changes_nothing(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    a = _dead(db_conn, "nd1", "retries_exhausted", None)
    b = _dead(db_conn, "nd2", "retries_exhausted", None)
    db_conn.execute("UPDATE transactions SET status = 'succeeded' WHERE transaction_id = 'nd2-tx'")
    out = run("replay", str(a), str(b), "--yes")
    assert out.returncode == 2 and "no longer dead" in out.stderr
    assert _status(db_conn, "nd1") == ("dead", 8)


def test_replay_of_several_needs_a_confirmation(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    _dead(db_conn, "c1", "retries_exhausted", None)
    _dead(db_conn, "c2", "retries_exhausted", None)
    out = run("replay", "--all")
    assert out.returncode == 2 and "use --yes" in out.stderr
    dry = run("replay", "--all", "--dry-run")
    assert dry.returncode == 0 and "nothing changed" in dry.stdout
    assert _status(db_conn, "c1") == ("dead", 8)


def test_resolve_closes_by_hand(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    a = _dead(db_conn, "r1", "in_doubt_key_expired", 10**6)
    refused = run("replay", str(a))
    assert refused.returncode == 1 and "will not resend" in refused.stdout
    out = run("resolve", str(a), "--as", "succeeded", "--note", "gateway says paid", via="pw")
    assert out.returncode == 0, out.stderr
    assert _status(db_conn, "r1")[0] == "succeeded"
    row = db_conn.execute("SELECT resolved_by, resolution_note FROM dead_letters").fetchone()
    assert row == ("oncall-test", "gateway says paid")
    again = run("resolve", str(a), "--as", "failed", "--note", "x")
    assert again.returncode == 2
