"""Dead-letter replay and resolve with real workers against the simulator, the commands run
exactly as on-call types them (``celery -A payment_worker dlq ...``), the ledger checked:
each item paid exactly once, whatever is replayed, however often."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from payment_worker.worker.queueing import enqueue_batch
from tests.conftest import PwEnv, wait_until
from tests.integration.test_in_doubt import ACCT, _batch, _rows, _settle, _submit, _world

ROOT = Path(__file__).resolve().parents[2]


def dlq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "USER": "oncall-test", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "payment_worker", "dlq", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def _open_ids(reason: str | None = None) -> list[int]:
    args = ["list", "--json"] + (["--reason", reason] if reason else [])
    out = dlq(*args)
    assert out.returncode == 0, out.stderr
    return [int(r["id"]) for r in json.loads(out.stdout)]


def _wait_dead(batch_id: str, timeout: float) -> None:
    _settle(batch_id, timeout=timeout, until=("dead",))


def _paid_once(ledger: dict[str, Any], n: int) -> None:
    assert ledger["payments_sent"] == n and ledger["double_payments"] == [], ledger


def test_retries_exhausted_items_replayed_after_the_gateway_heals_are_paid_once(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    env = {"RETRY_MAX_ATTEMPTS": "2"}
    with _world(pw_env, tmp_path, {"p503": 1.0}, **env) as (sim, _):
        _submit(_batch("all503", n=3))
        _wait_dead("all503", timeout=40)
        assert len(_open_ids("retries_exhausted")) == 3
        sim.configure(p503=0.0)
        out = dlq("replay", "--all", "--yes")
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert "replayed=3" in out.stdout
        rows = _settle("all503", timeout=40, until=("succeeded",))
        _paid_once(sim.ledger(), 3)
        again = dlq("replay", "--all", "--yes")
        assert again.returncode == 0 and "nothing to replay" in again.stdout
        time.sleep(2.0)
        _paid_once(sim.ledger(), 3)
    assert {s for s, _ in rows.values()} == {"succeeded"}
    assert _open_ids() == []
    resolved = json.loads(dlq("list", "--json", "--status", "resolved").stdout)
    assert {r["resolved_by"] for r in resolved} == {"replay"}


def test_items_dead_after_a_503_storm_replay_after_the_retention_and_pay_once(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    # the gateway forgets keys after 2 s; the storm's sends all applied nothing, so nothing
    # of these items was ever in doubt and a replay long after the retention may send
    env = {
        "RETRY_MAX_ATTEMPTS": "2",
        "GATEWAY_KEY_RETENTION_SECONDS": "2",
        "IN_DOUBT_MAX_SECONDS": "0.5",
    }
    sim_flags = {"p503": 1.0, "key_retention_seconds": 2}
    with _world(pw_env, tmp_path, sim_flags, **env) as (sim, _):
        _submit(_batch("storm", n=2))
        _wait_dead("storm", timeout=40)
        sim.configure(p503=0.0)
        time.sleep(4.0)  # twice the retention
        out = dlq("replay", "--all", "--yes")
        assert out.returncode == 0 and "replayed=2" in out.stdout, (out.stdout, out.stderr)
        rows = _settle("storm", timeout=40, until=("succeeded",))
        _paid_once(sim.ledger(), 2)
    assert {s for s, _ in rows.values()} == {"succeeded"}


def test_unknown_unresolved_replayed_is_recorded_from_the_lookup_without_a_second_payment(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    env = {"GATEWAY_KEY_RETENTION_SECONDS": "120", "IN_DOUBT_MAX_SECONDS": "3"}
    with _world(pw_env, tmp_path, {"key_retention_seconds": 120}, **env) as (sim, _):
        sim.script(ACCT, {"fault": "outage_after_apply", "seconds": 10, "endpoint": "create"})
        _submit(_batch("lost"))
        _wait_dead("lost", timeout=30)
        [dl_id] = _open_ids("unknown_unresolved")
        # the outage runs 10 s from the first create, on the simulator's clock: on a loaded
        # host that create may come well after the submit, and a replay inside the outage
        # would only meet 503s and go dead again
        first_create = next(t for t, e, _ in sim.requests(ACCT) if e == "create")
        time.sleep(max(0.0, first_create + 10.5 - sim.now()))
        out = dlq("replay", str(dl_id), env=env)
        assert out.returncode == 0, (out.stdout, out.stderr)
        rows = _settle("lost", timeout=30, until=("succeeded",))
        _paid_once(sim.ledger(), 1)
        creates = sim.statuses(ACCT, "create")
    assert [s for s, _ in rows.values()] == ["succeeded"]
    assert len(creates) == 1  # the replay looked up and never sent again


def test_an_item_in_doubt_past_the_key_retention_is_never_replayed_and_resolved_by_hand(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    env = {"GATEWAY_KEY_RETENTION_SECONDS": "4", "IN_DOUBT_MAX_SECONDS": "1"}
    with _world(pw_env, tmp_path, {"key_retention_seconds": 4}, **env) as (sim, _):
        sim.script(ACCT, {"fault": "outage_after_apply", "seconds": 3, "endpoint": "create"})
        _submit(_batch("expired"))
        _wait_dead("expired", timeout=30)
        [dl_id] = _open_ids()
        time.sleep(5.0)  # the oldest send in doubt is now older than the key trust (3.6 s)
        shown = json.loads(dlq("show", str(dl_id), "--json", env=env).stdout)
        assert "will not resend: key retention passed, resolve by hand" in shown["replay_would"]
        out = dlq("replay", "--all", "--yes", env=env)
        assert out.returncode == 1 and "will not resend" in out.stdout, out.stdout
        time.sleep(2.0)
        assert [s for s, _ in _rows("expired").values()] == ["dead"]
        _paid_once(sim.ledger(), 1)
        done = dlq("resolve", str(dl_id), "--as", "succeeded", "--note", "gateway confirms")
        assert done.returncode == 0, done.stderr
        _paid_once(sim.ledger(), 1)
    assert [s for s, _ in _rows("expired").values()] == ["succeeded"]
    assert _open_ids() == []


def test_two_concurrent_replays_of_one_item_pay_once(pw_env: PwEnv, tmp_path: Path) -> None:
    with _world(pw_env, tmp_path, {"p503": 1.0}, RETRY_MAX_ATTEMPTS="1") as (sim, _):
        _submit(_batch("twice"))
        _wait_dead("twice", timeout=30)
        [dl_id] = _open_ids()
        sim.configure(p503=0.0)
        results: list[subprocess.CompletedProcess[str]] = []
        threads = [
            threading.Thread(target=lambda: results.append(dlq("replay", str(dl_id))))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        replayed = [r for r in results if r.returncode == 0]
        assert len(replayed) == 1, [(r.returncode, r.stdout, r.stderr) for r in results]
        _settle("twice", timeout=30, until=("succeeded",))
        time.sleep(1.0)
        _paid_once(sim.ledger(), 1)


def _publish_raw(broker_url: str, body: Any, headers: dict[str, Any], **publish: Any) -> None:
    """Put ``body`` on the payments queue as it is, with no producer of ours in between
    (``publish``: kombu's, e.g. ``serializer=None`` for bytes sent as they are)."""
    from kombu import Connection, Exchange, Queue

    publish.setdefault("serializer", "json")
    with Connection(broker_url) as conn:
        conn.Producer().publish(
            body,
            exchange="payments",
            routing_key="payments",
            headers=headers,
            declare=[Queue("payments", Exchange("payments"), routing_key="payments")],
            **publish,
        )


def _the_crash_dead_letter(timeout: float = 30) -> dict[str, Any]:
    """The one open ``task_crashed`` dead letter, as ``dlq list --json`` shows it, once the
    worker has written it."""
    rows: list[dict[str, Any]] = []

    def written() -> bool:
        out = dlq("list", "--json", "--reason", "task_crashed")
        assert out.returncode == 0, out.stderr
        rows[:] = json.loads(out.stdout)
        return bool(rows)

    wait_until(written, timeout, "a task_crashed dead letter")
    [row] = rows
    return row


def test_a_batch_id_that_does_not_exist_is_a_task_crashed_dead_letter(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    with _world(pw_env, tmp_path, {}):
        enqueue_batch("no-such-batch")
        row = _the_crash_dead_letter()
    assert row["error_class"] == "BatchMissing"
    assert row["payload"]["args"] == ["no-such-batch"]
    out = dlq("list")
    assert "task_crashed=1" in out.stdout
    with psycopg.connect(pw_env.database_url) as conn:
        assert conn.execute("SELECT count(*) FROM transactions").fetchone() == (0,)


def test_a_message_the_worker_cannot_decode_is_a_task_crashed_dead_letter(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    with _world(pw_env, tmp_path, {}):
        _publish_raw(
            pw_env.broker_url,
            b"{not json",
            headers={},
            content_type="application/json",
            content_encoding="utf-8",
            serializer=None,
        )
        row = _the_crash_dead_letter()
    assert "could not be decoded" in row["last_error"]


def test_a_task_message_celery_finds_invalid_is_a_task_crashed_dead_letter(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    # a protocol-1 message whose kwargs are no mapping: Celery's on_invalid_task rejects it
    body = {
        "task": "payment_worker.process_account_batch",
        "id": "invalid-1",
        "args": ["b-1"],
        "kwargs": ["not", "a", "mapping"],
    }
    with _world(pw_env, tmp_path, {}):
        _publish_raw(pw_env.broker_url, body, headers={})
        row = _the_crash_dead_letter()
    assert row["error_class"] == "InvalidTaskError", row
    # what the message named is kept: on-call sees which batch it was for
    assert row["payload"]["task_id"] == "invalid-1", row
    assert row["payload"]["batch_id"] == "b-1", row


def test_a_task_message_with_an_eta_that_is_no_time_is_a_task_crashed_dead_letter(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    headers = {
        "lang": "py",
        "task": "payment_worker.process_account_batch",
        "id": "bad-eta-1",
        "eta": "not-a-time",
        "retries": 0,
        "argsrepr": "('b-1',)",
        "kwargsrepr": "{}",
    }
    with _world(pw_env, tmp_path, {}):
        _publish_raw(pw_env.broker_url, [["b-1"], {}, {}], headers=headers)
        row = _the_crash_dead_letter()
    assert row["error_class"] == "InvalidTaskError", row
    assert "invalid ETA" in row["last_error"], row
    assert row["payload"]["task_id"] == "bad-eta-1", row
    assert row["payload"]["args"] == ["b-1"], row
    assert row["payload"]["batch_id"] == "b-1", row
