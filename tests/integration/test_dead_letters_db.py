"""The dead-letter statements (db/dead_letters.py) on a real database, without a worker: items
are made dead by hand the way the record statement makes them."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from payment_worker import runtime
from payment_worker.db import dead_letters as dlq
from payment_worker.db.work_store import PgWorkStore
from payment_worker.domain.statuses import TxStatus
from payment_worker.producer.submit import submit_batch

ACCT = "acct-dlq-db"
TRUST = 3600.0


def _dead(
    db_conn: psycopg.Connection[Any], batch_id: str, reason: str, doubt_age: float | None
) -> int:
    batch = {
        "batch_id": batch_id,
        "account_id": ACCT,
        "items": [
            {
                "transaction_id": f"{batch_id}-tx",
                "amount": 1000,
                "currency": "IDR",
                "beneficiary": {"bank_code": "014", "account_number": "1234567890", "name": "B"},
            }
        ],
    }
    assert submit_batch(batch, runtime=runtime.current()).status == "accepted"
    doubt = None if doubt_age is None else f"now() - interval '{doubt_age} seconds'"
    db_conn.execute(
        f"UPDATE transactions SET status = 'dead', attempts = 8, doubt_since = {doubt or 'NULL'}"
        " WHERE transaction_id = %s",
        (f"{batch_id}-tx",),
    )
    db_conn.execute(
        "UPDATE batches SET status = 'completed', dead_count = 1 WHERE batch_id = %s", (batch_id,)
    )
    row = db_conn.execute(
        "INSERT INTO dead_letters (transaction_pk, batch_pk, reason, attempts, payload)"
        ' SELECT t.id, t.batch_pk, %s, 8, \'{"last_error": "503"}\' FROM transactions t'
        " WHERE t.transaction_id = %s RETURNING id",
        (reason, f"{batch_id}-tx"),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _status(db_conn: psycopg.Connection[Any], batch_id: str) -> tuple[str, int]:
    row = db_conn.execute(
        "SELECT status, attempts FROM transactions WHERE transaction_id = %s", (f"{batch_id}-tx",)
    ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1])


def test_replay_moves_dead_to_unknown_once(rt: runtime.Runtime, db_conn: Any) -> None:
    dl_id = _dead(db_conn, "b1", "retries_exhausted", None)
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        assert [d.id for d in dlq.list_dead_letters(c)] == [dl_id]
        r = dlq.replay(c, dl_id, TRUST, "tester")
        assert (r.result, r.batch_id, r.account_id) == (dlq.REPLAYED, "b1", ACCT)
        assert _status(db_conn, "b1") == ("unknown", 0)
        again = dlq.replay(c, dl_id, TRUST, "tester")
        assert again.result == dlq.NOT_DEAD
        assert dlq.list_dead_letters(c) == []
        [d] = dlq.list_dead_letters(c, state="replayed")
        assert d.row["replay_count"] == 1 and d.state == "replayed"
        assert len(d.row["payload"]["replays"]) == 1
    batch = db_conn.execute("SELECT status FROM batches WHERE batch_id = 'b1'").fetchone()
    assert batch == ("processing",)


def test_replay_refuses_an_item_in_doubt_past_the_key_trust(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    dl_id = _dead(db_conn, "b2", "in_doubt_key_expired", TRUST + 10)
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        r = dlq.replay(c, dl_id, TRUST, "tester")
    assert r.result == dlq.KEY_EXPIRED and r.detail == dlq.WILL_NOT_RESEND
    assert _status(db_conn, "b2") == ("dead", 8)


def test_an_item_dead_past_the_key_trust_is_refused_whatever_trust_the_tool_runs_with(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    # a dlq run with a longer GATEWAY_KEY_RETENTION_SECONDS than the workers' (a review
    # found it replayed: only its age refused it, measured with the tool's trust)
    dl_id = _dead(db_conn, "b2b", "in_doubt_key_expired", 60)
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        r = dlq.replay(c, dl_id, 10**9, "tester")
    assert r.result == dlq.KEY_EXPIRED and r.detail == dlq.WILL_NOT_RESEND
    assert _status(db_conn, "b2b") == ("dead", 8)


def test_an_item_whose_only_lookups_were_its_replays_replays_at_any_age_again(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    """Its sends all answered "not applied", replayed, its replay's lookup a 404, sent and
    answered 503 again, dead again: never in doubt (no first_doubt_at). A lookup alone
    proves nothing: before, any lookup dated it from its creation, and its second replay
    was refused past the key trust (a review found it)."""
    dl_id = _dead(db_conn, "b2c", "retries_exhausted", None)
    db_conn.execute(
        "UPDATE transactions SET lookups = 2, created_at = now() - interval '2 days'"
        " WHERE transaction_id = 'b2c-tx'"
    )
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        r = dlq.replay(c, dl_id, TRUST, "tester")
    assert r.result == dlq.REPLAYED
    assert _status(db_conn, "b2c") == ("unknown", 0)


def test_a_never_in_doubt_item_replays_at_any_age(rt: runtime.Runtime, db_conn: Any) -> None:
    dl_id = _dead(db_conn, "b3", "retries_exhausted", None)
    db_conn.execute("UPDATE dead_letters SET created_at = now() - interval '30 days'")
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        assert dlq.replay(c, dl_id, TRUST, "t").result == dlq.REPLAYED


def test_a_replayed_item_never_in_doubt_dates_its_doubt_from_its_first_claim(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    """A replayed item that was never in doubt comes back ``unknown`` with no ``doubt_since``.
    Its first holder may send it in that step (after a lookup 404): if that holder's record
    is lost (a crash), the doubt must still date from that claim, or the in-doubt bound
    would never apply and a 404 long past the key retention would send it again."""
    dl_id = _dead(db_conn, "b3b", "retries_exhausted", None)
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        assert dlq.replay(c, dl_id, TRUST, "t").result == dlq.REPLAYED
    store = PgWorkStore(rt.autocommit_engine)
    [first] = store.fence_and_claim(ACCT, 5)
    assert first.status is TxStatus.UNKNOWN  # looked up before any send
    assert first.doubt_age is not None and first.doubt_age < 1.0
    # ... but that stand-in date does not make it "once in doubt" (first_doubt_at): had its
    # record come, its sends all answered "not applied", it would replay at any age again
    assert first.first_doubt_age is None
    time.sleep(0.3)
    # the first holder crashed without a record: the next holder's doubt is the first's,
    # and now it was once in doubt (that holder's send may have left)
    [again] = store.fence_and_claim(ACCT, 5)
    assert again.status is TxStatus.UNKNOWN
    assert again.doubt_age is not None and again.doubt_age >= 0.3
    assert again.first_doubt_age is not None and again.first_doubt_age >= 0.3


def test_two_concurrent_replays_one_wins(rt: runtime.Runtime, db_conn: Any) -> None:
    dl_id = _dead(db_conn, "b4", "retries_exhausted", 10)
    results: list[str] = []
    barrier = threading.Barrier(8)

    def go() -> None:
        with rt.engine.connect() as c:
            c = c.execution_options(isolation_level="AUTOCOMMIT")
            barrier.wait()
            results.append(dlq.replay(c, dl_id, TRUST, "t").result)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted([dlq.REPLAYED] + [dlq.NOT_DEAD] * 7)
    row = db_conn.execute("SELECT replay_count FROM dead_letters").fetchone()
    assert row == (1,)


def test_resolve_closes_a_dead_item_by_hand(rt: runtime.Runtime, db_conn: Any) -> None:
    dl_id = _dead(db_conn, "b5", "in_doubt_key_expired", TRUST + 10)
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        assert dlq.resolve(c, dl_id, "succeeded", "paid per gateway", "oncall") == dlq.RESOLVED
        assert dlq.resolve(c, dl_id, "failed", "again", "oncall") == dlq.NOT_DEAD
        assert dlq.resolve(c, 999, "failed", "x", "oncall") == dlq.NOT_FOUND
        [d] = dlq.list_dead_letters(c, state="resolved")
    assert d.row["resolved_by"] == "oncall" and d.row["resolution_note"] == "paid per gateway"
    assert _status(db_conn, "b5")[0] == "succeeded"
    counts = db_conn.execute(
        "SELECT succeeded_count, dead_count FROM batches WHERE batch_id = 'b5'"
    ).fetchone()
    assert counts == (1, 0)


def test_a_task_crash_without_a_batch_is_recorded(rt: runtime.Runtime, db_conn: Any) -> None:
    with rt.engine.begin() as c:
        dl_id = dlq.record_task_crash(
            c,
            task_name="payment_worker.process_account_batch",
            args=["nope"],
            error_class="BatchMissing",
            error="no batch 'nope'",
            traceback_digest="abc",
            batch_id="nope",
            task_id="t1",
        )
    with rt.engine.connect() as c:
        [d] = dlq.list_dead_letters(c, reason="task_crashed")
        assert d.id == dl_id and d.state == "open"
        assert dlq.replay(c, dl_id, TRUST, "t").result == dlq.NO_TRANSACTION


def test_the_state_snapshot_counts_replays_resolutions_and_the_oldest_open(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    from payment_worker.db.reports import state_snapshot

    a = _dead(db_conn, "m1", "retries_exhausted", None)
    b = _dead(db_conn, "m2", "key_conflict", None)
    _dead(db_conn, "m3", "key_conflict", None)
    db_conn.execute("UPDATE dead_letters SET created_at = now() - interval '1 hour'")
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        assert dlq.replay(c, a, TRUST, "t").result == dlq.REPLAYED
        assert dlq.resolve(c, b, "failed", "declined per gateway", "t") == dlq.RESOLVED
    with rt.engine.begin() as c:
        snap = state_snapshot(c, statement_timeout_ms=5000)
    assert snap.dead_letters_replayed == {"retries_exhausted": 1}
    assert snap.dead_letters_resolved == {"retries_exhausted": 0, "key_conflict": 1}
    # a replayed dead letter stays open until its item finishes
    assert snap.dead_letters_open == {"retries_exhausted": 1, "key_conflict": 1}
    assert 3600 <= snap.oldest_open_dead_letter_age < 3700
    # the replayed item dies again, for another reason: its dead letter's reason changes
    # (the worker's record), and the replay is still counted where it was (before, the
    # retries_exhausted series went from 1 to 0: a counter reset to Prometheus)
    db_conn.execute("UPDATE dead_letters SET reason = 'unknown_unresolved' WHERE id = %s", (a,))
    with rt.engine.begin() as c:
        snap = state_snapshot(c, statement_timeout_ms=5000)
    assert snap.dead_letters_replayed == {"retries_exhausted": 1}


def test_the_task_failure_hook_writes_a_task_crashed_dead_letter(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    import sys

    from payment_worker.worker import dlq as hooks

    _dead(db_conn, "crash", "retries_exhausted", None)

    class FakeTask:
        name = "payment_worker.process_account_batch"

    try:
        raise ValueError("boom")
    except ValueError as exc:
        hooks._on_task_failure(
            sender=FakeTask(),
            task_id="t-1",
            exception=exc,
            args=["crash"],
            kwargs={},
            traceback=sys.exc_info()[2],
        )
    row = db_conn.execute(
        "SELECT d.error_class, d.payload, b.batch_id FROM dead_letters d"
        " LEFT JOIN batches b ON b.id = d.batch_pk WHERE d.reason = 'task_crashed'"
    ).fetchone()
    assert row is not None
    error_class, payload, batch_id = row
    assert (error_class, batch_id) == ("ValueError", "crash")
    assert payload["last_error"] == "boom" and payload["task_id"] == "t-1"
    assert payload["args"] == ["crash"] and len(payload["traceback_digest"]) > 16


def test_key_conflict_and_fingerprint_mismatch_are_never_replayed(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    a = _dead(db_conn, "kc", "key_conflict", None)
    b = _dead(db_conn, "fm", "fingerprint_mismatch", None)
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        ra, rb = dlq.replay(c, a, TRUST, "t"), dlq.replay(c, b, TRUST, "t")
    assert (ra.result, rb.result) == (dlq.NOT_REPLAYABLE, dlq.NOT_REPLAYABLE)
    assert "resolve by hand" in ra.detail
    assert _status(db_conn, "kc") == ("dead", 8) and _status(db_conn, "fm") == ("dead", 8)


def test_since_finds_an_item_that_died_again_after_its_replay(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    """A replayed item that dies again keeps its dead letter, written 3 hours ago: it died
    within the last hour, so ``--since 1h`` lists it (before, it filtered on the letter's
    first ``created_at`` only). One that died 3 hours ago and stayed dead is not listed."""
    again = _dead(db_conn, "re1", "retries_exhausted", None)
    old = _dead(db_conn, "re2", "retries_exhausted", None)
    db_conn.execute("UPDATE dead_letters SET created_at = now() - interval '3 hours'")
    db_conn.execute("UPDATE transactions SET updated_at = now() - interval '3 hours'")
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        assert dlq.replay(c, again, TRUST, "tester").result == dlq.REPLAYED
        # its next holder's record: dead again (the record statement's conflict update
        # keeps the open letter and its created_at)
        db_conn.execute(
            "UPDATE transactions SET status = 'dead', updated_at = now()"
            " WHERE transaction_id = 're1-tx'"
        )
        assert [d.id for d in dlq.list_dead_letters(c, since_seconds=3600)] == [again]
        assert [d.id for d in dlq.list_dead_letters(c)] == [again, old]


def test_a_crash_whose_text_holds_a_nul_is_written(rt: runtime.Runtime, db_conn: Any) -> None:
    """An exception's text with a NUL in it (a message that does not decode): written with
    U+FFFD, not refused by Postgres and retried without end."""
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        dl_id = dlq.record_task_crash(
            c,
            task_name="payment_worker.process_account_batch",
            args=["b\x00"],
            error_class="DecodeError",
            error="message could not be decoded: b'\x00\x01'",
            traceback_digest="d",
            batch_id=None,
            task_id="t-1",
        )
    row = db_conn.execute(
        "SELECT payload->>'last_error', payload->'args'->>0 FROM dead_letters WHERE id = %s",
        (dl_id,),
    ).fetchone()
    assert row == ("message could not be decoded: b'\ufffd\x01'", "b\ufffd")


def test_an_item_once_looked_up_replays_only_within_the_trust_from_its_creation(
    rt: runtime.Runtime, db_conn: Any
) -> None:
    """A 404 cleared the doubt of these items and they died later with no attempt left
    (``doubt_since`` NULL, ``lookups`` > 0, their first doubt kept in ``first_doubt_at``,
    here at their creation), as the claim and the record statement leave them. A send of
    theirs may still have landed after that 404 (a paused holder's): past the key trust from
    that first doubt a replay would meet the gateway's forgetting and pay again, so it is
    refused, and ``show`` says so; within it the replay dates the doubt from it, so the next
    holder judges its 404 by that date. One never in doubt replays at any age."""
    old = _dead(db_conn, "lk-old", "retries_exhausted", None)
    young = _dead(db_conn, "lk-young", "retries_exhausted", None)
    never = _dead(db_conn, "lk-never", "retries_exhausted", None)
    db_conn.execute(
        "UPDATE transactions SET lookups = 2, created_at = now() - CASE transaction_id"
        f" WHEN 'lk-old-tx' THEN interval '{TRUST + 600} seconds' ELSE interval '10 minutes' END"
        " WHERE transaction_id IN ('lk-old-tx', 'lk-young-tx')"
    )
    db_conn.execute(
        "UPDATE transactions SET first_doubt_at = created_at"
        " WHERE transaction_id IN ('lk-old-tx', 'lk-young-tx')"
    )
    db_conn.execute(
        "UPDATE transactions SET created_at = now() - interval '30 days'"
        " WHERE transaction_id = 'lk-never-tx'"
    )
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        shown = dlq.get_dead_letter(c, old)
        assert shown is not None and shown.row["doubt_age"] >= TRUST + 600
        refused = dlq.replay_refusal(c, old, TRUST)
        assert refused is not None and refused.result == dlq.KEY_EXPIRED
        r = dlq.replay(c, old, TRUST, "t")
        assert r.result == dlq.KEY_EXPIRED and r.detail == dlq.WILL_NOT_RESEND
        assert dlq.replay(c, young, TRUST, "t").result == dlq.REPLAYED
        assert dlq.replay(c, never, TRUST, "t").result == dlq.REPLAYED
    assert _status(db_conn, "lk-old") == ("dead", 8)
    dated = dict(
        db_conn.execute(
            "SELECT transaction_id, doubt_since = created_at FROM transactions"
            " WHERE transaction_id IN ('lk-young-tx', 'lk-never-tx')"
        ).fetchall()
    )
    assert dated == {"lk-young-tx": True, "lk-never-tx": None}
