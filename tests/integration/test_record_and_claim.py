"""A drain's chunk boundary in one statement (``db.work.record_and_claim``), on a real
Postgres: the chunk's outcomes written, the batches that ended in it completed, the next
chunk claimed with its intent recorded; never a row it records claimed again; nothing
written under a stale token."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import text

from payment_worker.db.work import record_and_claim
from payment_worker.db.work_store import PgWorkStore
from payment_worker.dev.samples import make_batches
from payment_worker.domain.statuses import KeyStatus, TxStatus
from payment_worker.domain.transitions import Decision, ItemOutcome
from payment_worker.errors import FencedOut
from payment_worker.producer.submit import submit_batch
from payment_worker.runtime import Runtime

ACCT = "acct-boundary"


def _submit(sizes: list[int]) -> list[str]:
    """One batch per size, all of ``ACCT``, in this order; returns their batch ids."""
    ids = []
    for n, size in enumerate(sizes):
        [batch] = make_batches(batches=1, items=size, accounts=1, prefix=f"bnd{n}")
        batch["account_id"] = ACCT
        assert submit_batch(batch, enqueue=False).status == "accepted"
        ids.append(batch["batch_id"])
    return ids


def _succeeded(item_id: int, attempts: int) -> ItemOutcome:
    return ItemOutcome(
        item_id,
        attempts,
        0,
        Decision(TxStatus.SUCCEEDED, payment_id=f"p{item_id}", key_status=KeyStatus.APPLIED),
    )


def _statuses(db_conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, int]:
    rows = db_conn.execute("SELECT status, count(*) FROM transactions GROUP BY status").fetchall()
    return {str(s): int(n) for s, n in rows}


def test_a_boundary_records_completes_and_claims_in_one_statement(
    rt: Runtime, db_conn: psycopg.Connection[tuple[object, ...]]
) -> None:
    first, second = _submit([3, 4])
    store = PgWorkStore(rt.autocommit_engine)
    chunk = store.fence_and_claim(ACCT, 5)
    token = chunk.fence_token
    assert token is not None and len(chunk) == 5 and chunk.more_due
    ended = sorted({i.batch_pk for i in chunk} - {chunk[-1].batch_pk})
    assert len(ended) == 1  # the first batch ended inside the chunk
    updated, completed, nxt = store.record_and_claim(
        ACCT, token, [_succeeded(i.id, i.attempts) for i in chunk], ended, 5
    )
    assert updated == 5 and completed == [first]
    # the next chunk: the second batch's last two items, intent recorded, nothing more due
    assert [i.transaction_id for i in nxt] == [
        r[0]
        for r in db_conn.execute(
            "SELECT transaction_id FROM transactions t JOIN batches b ON b.id = t.batch_pk"
            " WHERE b.batch_id = %s ORDER BY t.id OFFSET 2",
            (second,),
        )
    ]
    assert not nxt.more_due and nxt.fence_token == token
    assert all(i.status is TxStatus.DISPATCHING and i.attempts == 1 for i in nxt)
    assert all(i.request_fingerprint for i in nxt)
    assert _statuses(db_conn) == {"succeeded": 5, "dispatching": 2}
    batches = dict(db_conn.execute("SELECT batch_id, status FROM batches").fetchall())
    assert batches == {first: "completed", second: "processing"}
    counts = db_conn.execute(
        "SELECT succeeded_count, failed_count, dead_count FROM batches WHERE batch_id = %s",
        (first,),
    ).fetchone()
    assert counts == (3, 0, 0)
    keys = db_conn.execute("SELECT status, count(*) FROM idempotency_keys GROUP BY status")
    assert dict(keys.fetchall()) == {"applied": 5, "new": 2}


def test_a_row_it_records_is_never_claimed_by_it_even_when_due_at_once(
    rt: Runtime, db_conn: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Its snapshot still reads the recorded rows as claimed (``dispatching``): claiming one
    would update a row twice in one statement. An item recorded as due again at once waits
    for the claim after."""
    _submit([4])
    with rt.autocommit_engine.connect() as conn:
        chunk = PgWorkStore(rt.autocommit_engine).fence_and_claim(ACCT, 2)
        token = chunk.fence_token
        assert token is not None and chunk.more_due
        again = Decision(TxStatus.RETRYABLE, delay=0.0, error_class="http_503")
        outcomes = [ItemOutcome(chunk[0].id, 1, 0, again), _succeeded(chunk[1].id, 1)]
        updated, completed, nxt = record_and_claim(conn, ACCT, token, outcomes, [], 2)
        conn.commit()
    assert updated == 2 and completed == []
    assert chunk[0].id not in {i.id for i in nxt}
    assert [i.id for i in nxt] == sorted(i.id for i in nxt) and len(nxt) == 2
    assert not nxt.more_due  # the retried row was not counted as due either
    assert _statuses(db_conn) == {"retryable": 1, "succeeded": 1, "dispatching": 2}
    # the claim after takes it, as a send (nothing was sent in doubt; the two rows the
    # boundary claimed and nobody recorded are taken as in doubt)
    later = PgWorkStore(rt.autocommit_engine).claim_due(ACCT, token, 5)
    assert [(i.id, i.status) for i in later] == [(chunk[0].id, TxStatus.DISPATCHING)] + [
        (i.id, TxStatus.UNKNOWN) for i in nxt
    ]


def test_a_stale_token_writes_nothing(
    rt: Runtime, db_conn: psycopg.Connection[tuple[object, ...]]
) -> None:
    _submit([2, 2])
    store = PgWorkStore(rt.autocommit_engine)
    chunk = store.fence_and_claim(ACCT, 2)
    token = chunk.fence_token
    assert token is not None
    with rt.autocommit_engine.connect() as conn:  # a newer holder's token
        conn.execute(text("UPDATE account_fences SET fence_token = fence_token + 1"))
        conn.commit()
    before = db_conn.execute("SELECT id, status, updated_at FROM transactions ORDER BY id")
    rows_before = before.fetchall()
    with pytest.raises(FencedOut):
        store.record_and_claim(
            ACCT, token, [_succeeded(i.id, 1) for i in chunk], [chunk[0].batch_pk], 2
        )
    after = db_conn.execute("SELECT id, status, updated_at FROM transactions ORDER BY id")
    assert after.fetchall() == rows_before
    completed = db_conn.execute("SELECT count(*) FROM batches WHERE status = 'completed'")
    assert completed.fetchone() == (0,)
