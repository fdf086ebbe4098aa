"""The processing loop in-process (no broker): real Postgres and Redis, the simulator over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from payment_worker import runtime
from payment_worker.db import work as repo
from payment_worker.db.engine import autocommit
from payment_worker.db.fences import next_fence_token
from payment_worker.dev.reconcile import reconcile
from payment_worker.dev.samples import make_batches
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.statuses import DeadReason, TxStatus
from payment_worker.domain.transitions import Decision, ItemOutcome
from payment_worker.errors import FencedOut
from payment_worker.producer.submit import submit_batch
from payment_worker.worker import drain as processing
from payment_worker.worker.queueing import ACCOUNT_HEADER, enqueue_batch
from tests.conftest import PwEnv
from tests.sim_fixtures import SimHandle


@pytest.fixture
def res(
    pw_env: PwEnv, gateway_sim: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> Iterator[runtime.Runtime]:
    monkeypatch.setenv("RETRY_BASE_DELAY", "0.05")
    monkeypatch.setenv("RETRY_MAX_DELAY", "0.2")
    monkeypatch.setenv("HOLD_WAIT_MAX_SECONDS", "1.0")
    monkeypatch.setenv("GATEWAY_READ_TIMEOUT", "0.5")
    runtime.reset()  # rebuilt from the settings above
    yield runtime.current()
    runtime.reset()


def _submit(batches: list[dict[str, Any]]) -> None:
    for b in batches:
        assert submit_batch(b, enqueue=False).status == "accepted"


def _batch_statuses(db_conn: psycopg.Connection) -> dict[str, int]:  # type: ignore[type-arg]
    rows = db_conn.execute("SELECT status, count(*) FROM batches GROUP BY status").fetchall()
    return {r[0]: r[1] for r in rows}


def _statuses(db_conn: psycopg.Connection) -> dict[str, int]:  # type: ignore[type-arg]
    rows = db_conn.execute("SELECT status, count(*) FROM transactions GROUP BY status").fetchall()
    return {r[0]: r[1] for r in rows}


def test_drains_every_batch_of_the_account(
    res: runtime.Runtime,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    batches = make_batches(batches=3, items=30, accounts=1, prefix="p", reject_every=10)
    _submit(batches)
    report = processing.run_account("acct-0000", batches[0]["batch_id"], res)
    assert report.result == "processed" and report.items == 90
    assert _statuses(db_conn) == {"succeeded": 81, "failed": 9}
    done = db_conn.execute("SELECT count(*) FROM batches WHERE status = 'completed'").fetchone()
    assert done == (3,)
    with runtime.current().engine.connect() as conn:
        rec = reconcile(conn, gateway_sim.ledger())
    assert rec.ok, rec.summary()
    # declined items carry the reason; succeeded ones the gateway payment id
    row = db_conn.execute(
        "SELECT last_error_class FROM transactions WHERE status = 'failed' LIMIT 1"
    ).fetchone()
    assert row is not None and row[0].startswith("declined"), row
    ok = db_conn.execute(
        "SELECT count(*) FROM transactions "
        "WHERE status = 'succeeded' AND gateway_payment_id IS NULL"
    ).fetchone()
    assert ok == (0,)


def test_contended_task_leaves_a_mark_and_the_holder_drains_it(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    first = make_batches(batches=1, items=5, accounts=1, prefix="c1")
    _submit(first)
    holder = res.account_lock("acct-0000")
    assert holder.acquire()
    try:
        second = make_batches(batches=1, items=5, accounts=1, prefix="c2")
        _submit(second)
        report = processing.run_account("acct-0000", second[0]["batch_id"], res)
        assert report.result == "contended"  # no retry, no spin: it just ends
        assert res.redis.exists(res.keys.waiting("acct-0000"))
    finally:
        holder.release()
    # the next execution (as the holder would after its release) drains both batches
    report = processing.run_account("acct-0000", first[0]["batch_id"], res)
    assert report.items == 10
    assert _statuses(db_conn) == {"succeeded": 10}


def test_transient_errors_retry_then_dead_letter(
    res: runtime.Runtime,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(res.settings, "retry_max_attempts", 3)
    gateway_sim.configure(p503=1.0)
    batches = make_batches(batches=1, items=4, accounts=1, prefix="r")
    _submit(batches)
    processing.run_account("acct-0000", batches[0]["batch_id"], res)
    assert _statuses(db_conn) == {"dead": 4}
    rows = db_conn.execute("SELECT reason, attempts FROM dead_letters ORDER BY id").fetchall()
    assert rows == [("retries_exhausted", 3)] * 4
    assert gateway_sim.ledger()["payments_sent"] == 0


def test_lost_responses_resolved_by_lookup_never_paid_twice(
    res: runtime.Runtime,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    gateway_sim.configure(p_lost=0.5)
    batches = make_batches(batches=2, items=20, accounts=1, prefix="l")
    _submit(batches)
    processing.run_account("acct-0000", batches[0]["batch_id"], res)
    gateway_sim.configure(p_lost=0.0)
    processing.run_account("acct-0000", batches[0]["batch_id"], res)
    assert _statuses(db_conn) == {"succeeded": 40}
    ledger = gateway_sim.ledger()
    assert ledger["double_payments"] == [] and ledger["payments_sent"] == 40
    lookups = db_conn.execute("SELECT sum(lookups) FROM transactions").fetchone()
    assert lookups is not None and lookups[0] > 0  # the lost ones were looked up, not resent blind


def test_crash_between_intent_and_outcome_is_looked_up(
    res: runtime.Runtime,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    batches = make_batches(batches=1, items=3, accounts=1, prefix="x")
    _submit(batches)
    # a holder records intent, then "crashes" before any outcome is written
    lock = res.account_lock("acct-0000")
    assert lock.acquire()
    with autocommit(res.engine).connect() as conn:
        items = repo.claim_due(conn, "acct-0000", lock.fence_token or 0, 10)
    # ... and it did pay the first one before dying
    it = items[0]
    req = PaymentRequest(
        it.account_id, it.transaction_id, it.amount, it.currency, it.beneficiary, it.description
    )
    assert res.gateway.create_payment(it.account_id, req, it.idempotency_key).http_status == 201
    lock.release()
    assert _statuses(db_conn) == {"dispatching": 3}
    processing.run_account("acct-0000", batches[0]["batch_id"], res)
    assert _statuses(db_conn) == {"succeeded": 3}
    ledger = gateway_sim.ledger()
    assert ledger["payments_sent"] == 3 and ledger["double_payments"] == []
    looked = db_conn.execute("SELECT lookups FROM transactions ORDER BY id").fetchall()
    assert looked == [(1,), (1,), (1,)]


def test_old_holder_is_fenced_out(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    batches = make_batches(batches=1, items=2, accounts=1, prefix="f")
    _submit(batches)
    with autocommit(res.engine).connect() as conn:
        old = next_fence_token(conn, "acct-0000")
        items = repo.claim_due(conn, "acct-0000", old, 10)
        assert len(items) == 2
        new = next_fence_token(conn, "acct-0000")
        assert new > old
        with pytest.raises(FencedOut):
            repo.record_outcomes(
                conn,
                "acct-0000",
                old,
                [ItemOutcome(i.id, 1, 0, Decision(TxStatus.SUCCEEDED)) for i in items],
            )
        with pytest.raises(FencedOut):
            repo.claim_due(conn, "acct-0000", old, 10)
        assert _statuses(db_conn) == {"dispatching": 2}
        done = [ItemOutcome(i.id, 1, 0, Decision(TxStatus.SUCCEEDED)) for i in items]
        assert repo.record_outcomes(conn, "acct-0000", new, done) == 2
        # completing the batch is fenced too: the old holder changes nothing, the new one does
        assert repo.complete_batches(conn, "acct-0000", old) == []
        assert repo.complete_batches(conn, "acct-0000", new) == [batches[0]["batch_id"]]


def test_complete_and_next_due_is_one_fenced_statement(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    batches = make_batches(batches=2, items=2, accounts=1, prefix="cn")
    _submit(batches)
    with autocommit(res.engine).connect() as conn:
        token = next_fence_token(conn, "acct-0000")
        # nothing terminal yet: nothing completed, the open items are due now
        done, wait = repo.complete_and_next_due(conn, "acct-0000", token)
        assert done == [] and wait is not None and wait <= 0
        items = repo.claim_due(conn, "acct-0000", token, 2)  # the first batch's two items
        ok = Decision(TxStatus.SUCCEEDED)
        assert repo.record_outcomes(
            conn, "acct-0000", token, [ItemOutcome(i.id, 1, 0, ok) for i in items]
        )
        # a stale holder completes nothing: it learns that it was replaced
        newer = next_fence_token(conn, "acct-0000")
        with pytest.raises(FencedOut):
            repo.complete_and_next_due(conn, "acct-0000", token)
        assert _batch_statuses(db_conn) == {"processing": 1, "pending": 1}
        done, wait = repo.complete_and_next_due(conn, "acct-0000", newer)
        assert done == [batches[0]["batch_id"]] and wait is not None and wait <= 0
        rest = repo.claim_due(conn, "acct-0000", newer, 10)
        later = Decision(TxStatus.RETRYABLE, delay=30.0)
        outcomes = [ItemOutcome(i.id, 1, 0, later) for i in rest]
        assert repo.record_outcomes(conn, "acct-0000", newer, outcomes) == 2
        done, wait = repo.complete_and_next_due(conn, "acct-0000", newer)
        assert done == [] and wait is not None and 25 < wait <= 30
        # nothing open at all
        none = next_fence_token(conn, "acct-none")
        assert repo.complete_and_next_due(conn, "acct-none", none) == ([], None)


def test_a_claim_says_whether_more_is_due_and_claims_only_its_limit(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """Issue 13: the claim looks one row past its limit, so the drain knows without a
    second, empty claim that it took the last due item; that row is not claimed."""
    batches = make_batches(batches=2, items=2, accounts=1, prefix="md")
    _submit(batches)
    with autocommit(res.engine).connect() as conn:
        token = next_fence_token(conn, "acct-0000")
        first = repo.claim_due(conn, "acct-0000", token, 3)
        assert len(first) == 3 and first.more_due
        assert _statuses(db_conn) == {"dispatching": 3, "pending": 1}
        ok = Decision(TxStatus.SUCCEEDED)
        assert repo.record_outcomes(
            conn, "acct-0000", token, [ItemOutcome(i.id, 1, 0, ok) for i in first]
        )
        # the one left fills the next claim exactly: nothing more is due
        last = repo.claim_due(conn, "acct-0000", token, 1)
        assert len(last) == 1 and not last.more_due
        later = Decision(TxStatus.RETRYABLE, delay=30.0)
        outcome = ItemOutcome(last[0].id, 1, 0, later)
        assert repo.record_outcomes(conn, "acct-0000", token, [outcome])
        # a row that is open but not due yet is not "more due"
        rest = repo.claim_due(conn, "acct-0000", token, 1)
        assert list(rest) == [] and not rest.more_due
        assert _statuses(db_conn) == {"succeeded": 3, "retryable": 1}
        # a stale holder is still fenced out
        next_fence_token(conn, "acct-0000")
        with pytest.raises(FencedOut):
            repo.claim_due(conn, "acct-0000", token, 1)


def test_record_and_finish_writes_the_last_chunk_and_completes_in_one_statement(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """Issue 13: a drain's last chunk is recorded, its account's batches completed and the
    next due time read in one fenced statement, whose every part reads the snapshot from
    before it: the chunk's rows count as the statement writes them."""
    batches = make_batches(batches=2, items=2, accounts=1, prefix="rf")
    _submit(batches)
    counts = "SELECT status, succeeded_count, failed_count, dead_count FROM batches ORDER BY id"
    with autocommit(res.engine).connect() as conn:
        token = next_fence_token(conn, "acct-0000")
        items = repo.claim_due(conn, "acct-0000", token, 10)
        assert len(items) == 4 and not items.more_due
        a1, a2, b1, b2 = items
        ok, no = Decision(TxStatus.SUCCEEDED), Decision(TxStatus.FAILED)
        later = Decision(TxStatus.RETRYABLE, delay=30.0)
        outcomes = [
            ItemOutcome(a1.id, 1, 0, ok),
            ItemOutcome(a2.id, 1, 0, no),
            ItemOutcome(b1.id, 1, 0, ok),
            ItemOutcome(b2.id, 1, 0, later),
        ]
        # a replaced holder writes nothing at all
        newer = next_fence_token(conn, "acct-0000")
        with pytest.raises(FencedOut):
            repo.record_and_finish(conn, "acct-0000", token, outcomes)
        assert _statuses(db_conn) == {"dispatching": 4}
        changed, done, wait = repo.record_and_finish(conn, "acct-0000", newer, outcomes)
        # the first batch is complete with its counts; the second waits for its retry
        assert changed == 4 and done == [batches[0]["batch_id"]]
        assert wait is not None and 25 < wait <= 30
        assert db_conn.execute(counts).fetchall() == [
            ("completed", 1, 1, 0),
            ("processing", 0, 0, 0),
        ]
        db_conn.execute("UPDATE transactions SET next_attempt_at = now() WHERE id = %s", (b2.id,))
        [again] = repo.claim_due(conn, "acct-0000", newer, 10)
        changed, done, wait = repo.record_and_finish(
            conn, "acct-0000", newer, [ItemOutcome(again.id, 2, 0, ok)]
        )
        assert (changed, done, wait) == (1, [batches[1]["batch_id"]], None)
        assert db_conn.execute(counts).fetchall()[1] == ("completed", 2, 0, 0)


def test_a_fenced_out_drain_stops_and_counts_one_rejection(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prometheus_client import REGISTRY

    batches = make_batches(batches=1, items=2, accounts=1, prefix="r")
    _submit(batches)
    real_claim = repo.fence_and_claim

    def claim_then_a_takeover(*args: Any) -> repo.Claim:
        # the first claim issues this holder's token; a newer holder gets one right after
        claimed = real_claim(*args)
        with res.engine.begin() as conn:
            next_fence_token(conn, "acct-0000")
        return claimed

    monkeypatch.setattr(repo, "fence_and_claim", claim_then_a_takeover)
    before = REGISTRY.get_sample_value("payment_worker_fencing_rejections_total") or 0.0
    report = processing.run_account("acct-0000", batches[0]["batch_id"], res)
    assert report.result == "fenced_out" and report.items == 0
    assert REGISTRY.get_sample_value("payment_worker_fencing_rejections_total") == before + 1
    # sent under the older token, its outcomes refused: the next holder looks them up
    assert _statuses(db_conn) == {"dispatching": 2}


def test_a_long_drain_hands_the_account_back_to_the_queue(
    res: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import redis

    monkeypatch.setattr(res.settings, "drain_max_seconds", 0.01)
    monkeypatch.setattr(res.settings, "process_chunk_size", 5)
    batches = make_batches(batches=2, items=10, accounts=1, prefix="h")
    _submit(batches)
    broker = redis.Redis.from_url(pw_env.broker_url)
    report = processing.run_account("acct-0000", batches[0]["batch_id"], res)
    # one slice, then the lock is free and one continuation message waits in the broker
    assert report.handed_off and report.items == 5
    assert broker.llen("payments") == 1
    lock = res.account_lock("acct-0000")
    assert lock.acquire()
    lock.release()
    for _ in range(10):
        if not processing.run_account("acct-0000", batches[0]["batch_id"], res).handed_off:
            break
    assert _statuses(db_conn) == {"succeeded": 20}


def test_a_terminal_row_never_moves_back(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    batches = make_batches(batches=1, items=2, accounts=1, prefix="t", reject_every=2)
    _submit(batches)
    processing.run_account("acct-0000", batches[0]["batch_id"], res)
    before = db_conn.execute("SELECT id, status, attempts FROM transactions ORDER BY id").fetchall()
    assert [r[1] for r in before] == ["succeeded", "failed"]
    # a late writer (a slow holder's outcome, a replayed answer) records over final rows:
    # with a current token, so only the state condition can stop it
    with autocommit(res.engine).connect() as conn:
        token = next_fence_token(conn, "acct-0000")
        late = [
            ItemOutcome(
                r[0],
                9,
                9,
                Decision(
                    TxStatus.DEAD, error_class="late", dead_reason=DeadReason.RETRIES_EXHAUSTED
                ),
            )
            for r in before
        ]
        assert repo.record_outcomes(conn, "acct-0000", token, late) == 0
    after = db_conn.execute("SELECT id, status, attempts FROM transactions ORDER BY id").fetchall()
    assert after == before
    assert db_conn.execute("SELECT count(*) FROM dead_letters").fetchone() == (0,)


def test_the_account_from_the_message_header_spares_the_lookup(
    res: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 13: a message our publishers send names the batch's account in a header (a
    header, so an older worker ignores it); the task then runs no query to find it."""
    import base64
    import json

    import redis

    batches = make_batches(batches=1, items=3, accounts=1, prefix="h")
    _submit(batches)
    enqueue_batch(batches[0]["batch_id"], rt=res, account_id="acct-0000")
    raw = redis.Redis.from_url(pw_env.broker_url).lindex("payments", -1)
    assert raw is not None
    message = json.loads(raw)
    assert message["headers"][ACCOUNT_HEADER] == "acct-0000"
    args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
    assert args == [batches[0]["batch_id"]] and kwargs == {}  # the arguments are unchanged

    def no_lookup(*_: Any) -> str | None:
        raise AssertionError("the account was looked up")

    monkeypatch.setattr(processing, "_account_of", no_lookup)
    report = processing.run_batch_task(batches[0]["batch_id"], res, account_id="acct-0000")
    assert report.result == "processed" and report.items == 3
    assert _statuses(db_conn) == {"succeeded": 3}


def test_a_nul_character_in_the_gateways_answer_is_recorded_not_refused(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """Postgres refuses NUL in text and jsonb (a binary 502 body, a JSON "\\u0000"): the
    outcomes are recorded with it replaced, never refused at every try."""
    batches = make_batches(batches=1, items=2, accounts=1, prefix="nul")
    _submit(batches)
    with autocommit(res.engine).connect() as conn:
        token = next_fence_token(conn, "acct-0000")
        paid, odd = repo.claim_due(conn, "acct-0000", token, 2)
        outcomes = [
            ItemOutcome(paid.id, 1, 0, Decision(TxStatus.SUCCEEDED, payment_id="pay\x00-1")),
            ItemOutcome(
                odd.id,
                1,
                0,
                Decision(
                    TxStatus.DEAD,
                    error_class="http_502\x00",
                    error="\x1f\x8b\x00\x00 gzip without its header",
                    dead_reason=DeadReason.RETRIES_EXHAUSTED,
                ),
            ),
        ]
        assert repo.record_outcomes(conn, "acct-0000", token, outcomes) == 2
    rows = db_conn.execute(
        "SELECT status, gateway_payment_id, last_error_class, last_error FROM transactions"
        " ORDER BY id"
    ).fetchall()
    assert rows == [
        ("succeeded", "pay\ufffd-1", None, None),
        ("dead", None, "http_502\ufffd", "\x1f\x8b\ufffd\ufffd gzip without its header"),
    ]
    letter = db_conn.execute("SELECT payload->>'last_error' FROM dead_letters").fetchone()
    assert letter == ("\x1f\x8b\ufffd\ufffd gzip without its header",)


def test_a_step_that_sent_nothing_leaves_the_keys_status_as_it_was(
    res: runtime.Runtime,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """ "sent" means a request under the key may have applied: a step none of whose requests
    left (paced, token refused, given back untouched, a body that no longer matches) does not
    write it; one that reached the gateway with the outcome unknown does."""
    batches = make_batches(batches=1, items=3, accounts=1, prefix="keyst")
    _submit(batches)

    def keys() -> list[str]:
        rows = db_conn.execute(
            "SELECT k.status FROM idempotency_keys k JOIN transactions t"
            " ON t.id = k.transaction_pk ORDER BY t.id"
        ).fetchall()
        return [r[0] for r in rows]

    assert keys() == ["new", "new", "new"]
    with autocommit(res.engine).connect() as conn:
        token = next_fence_token(conn, "acct-0000")
        paced, mismatch, timed_out = repo.claim_due(conn, "acct-0000", token, 3)
        outcomes = [
            ItemOutcome(paced.id, 0, 0, Decision(TxStatus.RETRYABLE, delay=1.0)),
            ItemOutcome(
                mismatch.id,
                0,
                0,
                Decision(
                    TxStatus.DEAD,
                    error_class="fingerprint_mismatch",
                    dead_reason=DeadReason.FINGERPRINT_MISMATCH,
                ),
            ),
            ItemOutcome(timed_out.id, 1, 0, Decision(TxStatus.UNKNOWN, delay=1.0), reached=True),
        ]
        assert repo.record_outcomes(conn, "acct-0000", token, outcomes) == 3
    assert keys() == ["new", "new", "sent"]
