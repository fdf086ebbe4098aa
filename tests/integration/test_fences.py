"""Fencing tokens and fenced writes on real rows of the transactions table."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text, update

from payment_worker.db import fences
from payment_worker.db.engine import make_engine
from payment_worker.db.models import transactions
from payment_worker.errors import FencedOut
from tests.conftest import PwEnv

ACCOUNT = "acct-fence"
FENCED_UPDATE = text(
    "UPDATE transactions SET status = :status, fence_token = :fence_token, updated_at = now()"
    " WHERE id = :id AND status = :expected AND " + fences.FENCE_GUARD_SQL
)


def _rejections() -> float:
    return REGISTRY.get_sample_value("pw_fencing_rejections_total") or 0.0


@pytest.fixture
def engine(pw_env: PwEnv) -> Iterator[Engine]:
    eng = make_engine(pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    yield eng
    eng.dispose()


def _insert_tx(engine: Engine, account_id: str = ACCOUNT, tx: str = "tx-1") -> int:
    with engine.begin() as conn:
        batch_pk = conn.execute(
            text(
                "INSERT INTO batches (batch_id, account_id, fingerprint, item_count)"
                " VALUES (:b, :a, 'fp', 1) RETURNING id"
            ),
            {"b": f"batch-{account_id}-{tx}", "a": account_id},
        ).scalar_one()
        pk = conn.execute(
            text(
                "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount,"
                " currency, beneficiary, idempotency_key)"
                " VALUES (:bp, :a, :t, 100, 'IDR', '{}'::jsonb, :k) RETURNING id"
            ),
            {"bp": batch_pk, "a": account_id, "t": tx, "k": f"key-{account_id}-{tx}"},
        ).scalar_one()
    return int(pk)


def _row(engine: Engine, pk: int) -> tuple[str, int]:
    with engine.connect() as conn:
        status, token = conn.execute(
            text("SELECT status, fence_token FROM transactions WHERE id = :id"), {"id": pk}
        ).one()
    return str(status), int(token)


def _next(engine: Engine, account_id: str = ACCOUNT) -> int:
    with engine.begin() as conn:
        return fences.next_fence_token(conn, account_id)


def _write(engine: Engine, pk: int, token: int, status: str, expected: str) -> Any:
    with engine.begin() as conn:
        return fences.execute_fenced(
            conn,
            FENCED_UPDATE,
            {"id": pk, "status": status, "expected": expected},
            account_id=ACCOUNT,
            fence_token=token,
        ).rowcount


def test_tokens_start_at_one_grow_and_are_per_account(engine: Engine) -> None:
    with engine.begin() as conn:
        assert fences.current_fence_token(conn, ACCOUNT) == 0
    assert [_next(engine) for _ in range(3)] == [1, 2, 3]
    assert _next(engine, "other") == 1
    with engine.begin() as conn:
        assert fences.current_fence_token(conn, ACCOUNT) == 3
        assert fences.current_fence_token(conn, "other") == 1


def test_concurrent_acquisitions_get_distinct_growing_tokens(engine: Engine) -> None:
    with ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(lambda _: _next(engine), range(80)))
    assert sorted(tokens) == list(range(1, 81))


def test_current_holder_writes_and_older_holder_is_fenced_out(engine: Engine) -> None:
    pk = _insert_tx(engine)
    old = _next(engine)
    assert _write(engine, pk, old, "dispatching", "pending") == 1
    new = _next(engine)
    assert new > old
    before = _rejections()
    with pytest.raises(FencedOut):
        _write(engine, pk, old, "succeeded", "dispatching")
    assert _rejections() == before + 1
    # the old holder changed nothing; the new one still can
    assert _row(engine, pk) == ("dispatching", old)
    assert _write(engine, pk, new, "succeeded", "dispatching") == 1
    assert _row(engine, pk) == ("succeeded", new)


def test_state_mismatch_with_current_token_is_not_a_fence_rejection(engine: Engine) -> None:
    pk = _insert_tx(engine)
    token = _next(engine)
    before = _rejections()
    assert _write(engine, pk, token, "succeeded", "dispatching") == 0
    assert _rejections() == before
    assert _row(engine, pk) == ("pending", 0)


def test_token_without_any_acquisition_is_fenced_out(engine: Engine) -> None:
    pk = _insert_tx(engine)
    with pytest.raises(FencedOut):
        _write(engine, pk, 1, "dispatching", "pending")
    assert _row(engine, pk) == ("pending", 0)


def test_fence_guard_clause_in_a_core_update(engine: Engine) -> None:
    pk = _insert_tx(engine)
    old, new = _next(engine), _next(engine)

    def stmt(token: int) -> Any:
        return (
            update(transactions)
            .where(transactions.c.id == pk, fences.fence_guard(ACCOUNT, token))
            .values(status="dispatching", fence_token=token)
        )

    with engine.begin() as conn:
        assert conn.execute(stmt(old)).rowcount == 0
        with pytest.raises(FencedOut):
            fences.execute_fenced(conn, stmt(old), None, account_id=ACCOUNT, fence_token=old)
    with engine.begin() as conn:
        res = fences.execute_fenced(conn, stmt(new), None, account_id=ACCOUNT, fence_token=new)
        assert res.rowcount == 1
    assert _row(engine, pk) == ("dispatching", new)


def test_check_fence(engine: Engine) -> None:
    token = _next(engine)
    with engine.begin() as conn:
        fences.check_fence(conn, ACCOUNT, token)
    _next(engine)
    with engine.begin() as conn, pytest.raises(FencedOut):
        fences.check_fence(conn, ACCOUNT, token)


def test_guard_waits_for_an_uncommitted_newer_token_then_changes_nothing(engine: Engine) -> None:
    """A newer token being issued concurrently: the old writer waits, then is fenced out."""
    pk = _insert_tx(engine)
    old = _next(engine)
    outcome: dict[str, Any] = {}
    with engine.connect() as issuer:
        tx = issuer.begin()
        new = fences.next_fence_token(issuer, ACCOUNT)  # holds the fence row, not committed

        def old_writer() -> None:
            try:
                outcome["rows"] = _write(engine, pk, old, "dispatching", "pending")
            except FencedOut:
                outcome["fenced"] = time.monotonic()

        t = threading.Thread(target=old_writer)
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), "the guard must wait for the uncommitted newer token"
        committed_at = time.monotonic()
        tx.commit()
        t.join(5)
    assert "rows" not in outcome
    assert outcome["fenced"] >= committed_at
    assert _row(engine, pk) == ("pending", 0)
    assert new == old + 1


def test_newer_token_waits_until_a_passed_guard_commits(engine: Engine) -> None:
    """A write whose guard passed holds the fence row: the next token comes after its commit."""
    pk = _insert_tx(engine)
    old = _next(engine)
    issued: dict[str, Any] = {}
    with engine.connect() as writer:
        tx = writer.begin()
        rows = fences.execute_fenced(
            writer,
            FENCED_UPDATE,
            {"id": pk, "status": "dispatching", "expected": "pending"},
            account_id=ACCOUNT,
            fence_token=old,
        ).rowcount
        assert rows == 1

        def issuer() -> None:
            issued["token"] = _next(engine)
            issued["at"] = time.monotonic()

        t = threading.Thread(target=issuer)
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), "next_fence_token must wait for the fenced transaction"
        # still inside the fenced transaction: a second write is fenced too
        rows = fences.execute_fenced(
            writer,
            FENCED_UPDATE,
            {"id": pk, "status": "unknown", "expected": "dispatching"},
            account_id=ACCOUNT,
            fence_token=old,
        ).rowcount
        assert rows == 1
        committed_at = time.monotonic()
        tx.commit()
        t.join(5)
    assert issued["token"] == old + 1
    assert issued["at"] >= committed_at
    assert _row(engine, pk) == ("unknown", old)
    with pytest.raises(FencedOut):
        _write(engine, pk, old, "succeeded", "unknown")
