"""``payment-worker submit`` as a real process: input forms, exit codes, broker down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from tests.conftest import ROOT, PwEnv
from tests.integration.test_producer import broker_messages, counts, make_batch


def submit(
    args: list[str], stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", "submit", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_array_with_one_bad_batch_handles_each_on_its_own(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    bad = make_batch("b-2", tx="two")
    bad["items"][1]["amount"] = "1000"
    batches = [make_batch("b-1", tx="one"), bad, make_batch("b-3", tx="three"), 7]
    path = tmp_path / "batches.json"
    path.write_text(json.dumps(batches, indent=2))

    proc = submit([str(path)])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines(proc.stdout) == [
        {"batch_id": "b-1", "status": "accepted", "items": 3, "errors": []},
        {
            "batch_id": "b-2",
            "status": "rejected",
            "items": 3,
            "errors": [
                {
                    "path": "$.items[1].amount",
                    "message": "must be an integer in minor units (not a float, boolean or string)",
                }
            ],
        },
        {"batch_id": "b-3", "status": "accepted", "items": 3, "errors": []},
        {
            "batch_id": None,
            "status": "rejected",
            "items": 0,
            "errors": [{"path": "$", "message": "a batch must be a JSON object"}],
        },
    ]
    assert counts(db_conn) == (2, 6, 6)
    assert broker_messages(pw_env) == ["b-1", "b-3"]

    # the same file again: duplicates are fine, the bad batch still fails
    again = submit([str(path)])
    assert [r["status"] for r in lines(again.stdout)] == [
        "duplicate",
        "rejected",
        "duplicate",
        "rejected",
    ]
    assert again.returncode == 2
    assert broker_messages(pw_env) == ["b-1", "b-3"]


def test_single_object_from_stdin_and_json_lines(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    one = submit(["-"], stdin=json.dumps(make_batch("b-1", tx="one")))
    assert one.returncode == 0, one.stderr
    assert lines(one.stdout) == [
        {"batch_id": "b-1", "status": "accepted", "items": 3, "errors": []}
    ]

    jsonl = tmp_path / "batches.jsonl"
    jsonl.write_text(
        json.dumps(make_batch("b-1", tx="one"))
        + "\n\n"
        + json.dumps(make_batch("b-2", tx="two"))
        + "\n"
    )
    both = submit([str(jsonl)])
    assert both.returncode == 0, both.stderr
    assert [(r["batch_id"], r["status"]) for r in lines(both.stdout)] == [
        ("b-1", "duplicate"),
        ("b-2", "accepted"),
    ]
    assert counts(db_conn) == (2, 6, 6)


def test_a_broken_json_line_is_rejected_alone(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    text = "\n".join(
        [
            json.dumps(make_batch("b-1", tx="one")),
            '{"batch_id": "b-2", ',
            json.dumps(make_batch("b-3")),
        ]
    )
    proc = submit(["-"], stdin=text)
    assert proc.returncode == 2
    out = lines(proc.stdout)
    assert [(r["batch_id"], r["status"]) for r in out] == [
        ("b-1", "accepted"),
        (None, "rejected"),
        ("b-3", "accepted"),
    ]
    assert out[1]["errors"][0]["message"].startswith("line 2 is not valid JSON")
    assert counts(db_conn) == (2, 6, 6)


def test_a_first_line_with_a_duplicate_key_is_rejected_alone(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """A first line that is a whole JSON object but refused (a duplicate key) is a bad line of
    JSON lines, not a broken document: the other lines are still submitted (the whole input
    was refused before)."""
    dup = json.dumps(make_batch("b-1", tx="one"))[:-1] + ', "batch_id": "b-9"}'
    text = "\r\n".join([dup, json.dumps(make_batch("b-2"))])
    proc = submit(["-"], stdin=text)
    assert proc.returncode == 2, proc.stderr
    out = lines(proc.stdout)
    assert [(r["batch_id"], r["status"]) for r in out] == [(None, "rejected"), ("b-2", "accepted")]
    assert out[0]["errors"][0]["message"].startswith("line 1 is not valid JSON")
    assert "duplicate" in out[0]["errors"][0]["message"]
    assert counts(db_conn) == (1, 3, 3)


def test_json_lines_break_at_newlines_only(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    """A raw U+2028 inside a string of one line (valid JSON) does not cut that line in two:
    the line is judged whole (its description is refused as not printable) and the lines
    after it keep their numbers."""
    odd = make_batch("b-1", tx="one")
    odd["items"][1]["description"] = "first\u2028second"
    text = "\n".join(
        [json.dumps(odd, ensure_ascii=False), '{"batch_id": ', json.dumps(make_batch("b-3"))]
    )
    proc = submit(["-"], stdin=text)
    assert proc.returncode == 2, proc.stderr
    out = lines(proc.stdout)
    assert [(r["batch_id"], r["status"]) for r in out] == [
        ("b-1", "rejected"),
        (None, "rejected"),
        ("b-3", "accepted"),
    ]
    assert out[1]["errors"][0]["message"].startswith("line 2 is not valid JSON")
    assert counts(db_conn) == (1, 3, 3)


def test_input_that_is_not_json_exits_2_with_a_clear_message(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    broken = json.dumps([make_batch("b-1")], indent=2)[:-5]  # a truncated array
    binary = tmp_path / "batch.bin"
    binary.write_bytes(b"\x80\xff{}")
    cases = {
        "truncated": submit(["-"], stdin=broken),
        "garbage": submit(["-"], stdin="hello, world"),
        "empty": submit(["-"], stdin=""),
        "missing file": submit([str(tmp_path / "nope.json")]),
        "binary": submit([str(binary)]),
    }
    for name, proc in cases.items():
        assert proc.returncode == 2, name
        assert proc.stdout == "", name
        assert proc.stderr.startswith("payment-worker submit: "), (name, proc.stderr)
        assert "Traceback" not in proc.stderr, name
    assert "input is not valid JSON" in cases["truncated"].stderr
    assert "cannot read" in cases["missing file"].stderr
    assert "not UTF-8" in cases["binary"].stderr
    assert counts(db_conn) == (0, 0, 0)


def deep_in(field: str, deep_json: str) -> str:
    """A valid batch, pretty-printed, whose first item's ``field`` (``beneficiary.name`` for a
    beneficiary field) holds the JSON text ``deep_json``."""
    batch = make_batch("b-1")
    target = batch["items"][0]
    if field.startswith("beneficiary."):
        target, field = target["beneficiary"], field.split(".")[1]
    target[field] = "@deep@"
    return json.dumps(batch, indent=2).replace('"@deep@"', deep_json)


def test_deep_nesting_exits_2_with_one_line_and_saves_nothing(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    deep = 100_000  # far beyond Python's recursion limit
    arrays = "[" * deep + "]" * deep
    objects = '{"a":' * deep + "1" + "}" * deep
    cases = {
        "arrays": submit(["-"], stdin="[" * deep),
        "objects": submit(["-"], stdin='{"a":' * deep),
        "beneficiary": submit(["-"], stdin=deep_in("beneficiary", objects)),
        "beneficiary name": submit(["-"], stdin=deep_in("beneficiary.name", arrays)),
        # a valid batch first: the whole input is refused, not the batches before the bad one
        "description": submit(
            ["-"], stdin=f"[{json.dumps(make_batch('b-0'))}, {deep_in('description', arrays)}]"
        ),
    }
    for name, proc in cases.items():
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert proc.stdout == "", name
        assert "Traceback" not in proc.stderr, name
        [line] = proc.stderr.splitlines()
        assert line.startswith(
            "payment-worker submit: input is refused: JSON nested more than 32 levels deep: "
        ), (name, line)
    assert counts(db_conn) == (0, 0, 0)
    assert broker_messages(pw_env) == []


def test_nesting_within_the_limit_is_rejected_with_its_path(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    name = "[" * 20 + "]" * 20  # deep enough to be wrong, not to be refused unparsed
    text = "\n".join(
        [
            deep_in("beneficiary.name", name).replace("\n", ""),
            '{"a":' * 100_000,  # a JSON line of its own: refused alone, like a broken line
        ]
    )
    proc = submit(["-"], stdin=text)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    first, second = lines(proc.stdout)
    assert first == {
        "batch_id": "b-1",
        "status": "rejected",
        "items": 3,
        "errors": [{"path": "$.items[0].beneficiary.name", "message": "must be a string"}],
    }
    assert second["status"] == "rejected"
    assert second["errors"][0]["message"].startswith(
        "line 2 is refused: JSON nested more than 32 levels deep: line 1 column 161 "
    )
    assert counts(db_conn) == (0, 0, 0)


def test_broker_down_submission_succeeds_and_batch_waits_pending(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    batches = [make_batch("b-1", tx="one"), make_batch("b-2", tx="two"), make_batch("b-3")]
    started = time.monotonic()
    proc = submit(
        ["-"], stdin=json.dumps(batches), env={"CELERY_BROKER_URL": "redis://127.0.0.1:1/0"}
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert [r["status"] for r in lines(proc.stdout)] == ["accepted"] * 3
    assert "sweeper" in proc.stderr
    assert "enqueue_failed" in proc.stderr
    assert "Traceback" not in proc.stderr
    # one failed publish, then the rest are not tried: no long stall per batch
    assert proc.stderr.count("enqueue_failed") == 1
    assert elapsed < 20
    rows = db_conn.execute("SELECT batch_id, status FROM batches ORDER BY id")
    assert rows.fetchall() == [("b-1", "pending"), ("b-2", "pending"), ("b-3", "pending")]
    assert counts(db_conn) == (3, 9, 9)
    assert broker_messages(pw_env) == []


def test_the_example_file_is_accepted(pw_env: PwEnv, db_conn: psycopg.Connection[Any]) -> None:
    proc = submit([str(ROOT / "payment_worker" / "dev" / "sample-batch.json")])
    assert proc.returncode == 0, proc.stderr
    out = lines(proc.stdout)
    assert [(r["status"], r["items"]) for r in out] == [("accepted", 10)] * 3
    accounts = db_conn.execute("SELECT DISTINCT account_id FROM batches ORDER BY 1").fetchall()
    assert accounts == [("acct-42",), ("acct-77",)]
    declined = db_conn.execute(
        "SELECT count(*) FROM transactions WHERE beneficiary->>'account_number' LIKE 'REJECT%'"
    ).fetchone()
    assert declined == (1,)


def test_a_closed_output_stops_with_one_line_naming_the_last_batch(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """``submit FILE | head -1``: the reader goes away after the first line. Before, a
    traceback and exit 1 with no word on which batches were saved."""
    path = tmp_path / "many.jsonl"
    path.write_text(
        "\n".join(json.dumps(make_batch(f"p-{i:03d}", account=f"a-{i}", n=1)) for i in range(300))
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "payment_worker.cli", "submit", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=dict(os.environ),
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    assert json.loads(first)["status"] == "accepted"
    proc.stdout.close()  # what `head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1, err
    assert "Traceback" not in err
    # (the rest of stderr is the log stream)
    said = [line for line in err.splitlines() if line.startswith("payment-worker")]
    assert len(said) == 1 and "the output was closed after batch 'p-" in said[0], err
    last = said[0].split("after batch '", 1)[1].split("'", 1)[0]
    # that batch and every one before it were saved; none after it was tried
    saved = [r[0] for r in db_conn.execute("SELECT batch_id FROM batches ORDER BY batch_id")]
    assert saved == [f"p-{i:03d}" for i in range(int(last[2:]) + 1)]


def test_a_batch_id_the_output_cannot_encode_is_written_escaped_not_a_traceback(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """stdout in Latin-1 (a locale or PYTHONIOENCODING) and a batch id in Chinese: before,
    the answer line raised UnicodeEncodeError after the batch was saved and enqueued (a
    traceback, no line, the batches after it not tried; a review found it). Now the line is
    the same JSON value with its text escaped."""
    batch = make_batch("账户-1", tx="cjk")
    proc = submit(["-"], stdin=json.dumps(batch), env={"PYTHONIOENCODING": "latin-1"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "\\u8d26" in proc.stdout
    assert lines(proc.stdout) == [
        {"batch_id": "账户-1", "status": "accepted", "items": 3, "errors": []}
    ]
    assert counts(db_conn) == (1, 3, 3)
