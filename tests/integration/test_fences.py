"""Fencing tokens and fenced writes on real rows of the transactions table.

The writes here are fenced exactly like the worker's (``FENCE_CTE`` + ``execute_fenced``);
``claim_due``/``record_outcomes`` against a stale token are in test_processing.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from payment_worker.db import fences, work
from payment_worker.db.engine import make_engine
from payment_worker.errors import FencedOut
from tests.conftest import PwEnv

ACCOUNT = "acct-fence"
FENCED_UPDATE = text(f"""
WITH {fences.FENCE_CTE},
upd AS (
    UPDATE transactions t SET status = :status, fence_token = :tok, updated_at = now()
    FROM fence WHERE t.id = :id AND t.status = :expected
    RETURNING t.id
)
SELECT (SELECT count(*) FROM upd) AS updated, (SELECT count(*) FROM fence) AS fenced_ok
""")


def _rejections() -> float:
    return REGISTRY.get_sample_value("payment_worker_fencing_rejections_total") or 0.0


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


def _current(engine: Engine, account_id: str) -> int:
    with engine.connect() as conn:
        token = conn.execute(
            text("SELECT fence_token FROM account_fences WHERE account_id = :a"), {"a": account_id}
        ).scalar_one_or_none()
    return 0 if token is None else int(token)


def _fenced_update(conn: Any, pk: int, token: int, status: str, expected: str) -> int:
    rows = fences.execute_fenced(
        conn,
        FENCED_UPDATE,
        {"id": pk, "status": status, "expected": expected},
        account_id=ACCOUNT,
        token=token,
    )
    return int(rows[0]["updated"])


def _write(engine: Engine, pk: int, token: int, status: str, expected: str) -> int:
    with engine.begin() as conn:
        return _fenced_update(conn, pk, token, status, expected)


def _waits_for_the_fence(
    engine: Engine,
    pk: int,
    token: int,
    write: tuple[str, str],
    newer: Callable[[], None],
    what: str,
    inside: Callable[[Any], None] | None = None,
) -> float:
    """Hold a passed fence of ``token`` (the fenced ``write`` (status, expected) of ``pk``,
    uncommitted), start ``newer`` in a thread, check that it waits, run ``inside`` in the
    still-open transaction, commit, and return the time of the commit once ``newer`` ended."""
    with engine.connect() as writer:
        tx = writer.begin()
        assert _fenced_update(writer, pk, token, *write) == 1
        t = threading.Thread(target=newer)
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), f"{what} must wait for the fenced transaction"
        if inside is not None:
            inside(writer)
        committed_at = time.monotonic()
        tx.commit()
        t.join(5)
    return committed_at


def test_tokens_start_at_one_grow_and_are_per_account(engine: Engine) -> None:
    assert _current(engine, ACCOUNT) == 0
    assert [_next(engine) for _ in range(3)] == [1, 2, 3]
    assert _next(engine, "other") == 1
    assert _current(engine, ACCOUNT) == 3
    assert _current(engine, "other") == 1


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
    # the data layer only raises; the caller that handles FencedOut counts it
    assert _rejections() == before
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


def test_fence_waits_for_an_uncommitted_newer_token_then_changes_nothing(engine: Engine) -> None:
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
        assert t.is_alive(), "the fence must wait for the uncommitted newer token"
        committed_at = time.monotonic()
        tx.commit()
        t.join(5)
    assert "rows" not in outcome
    assert outcome["fenced"] >= committed_at
    assert _row(engine, pk) == ("pending", 0)
    assert new == old + 1


def test_newer_token_waits_until_a_passed_fence_commits(engine: Engine) -> None:
    """A write whose fence passed holds the fence row: the next token comes after its commit."""
    pk = _insert_tx(engine)
    old = _next(engine)
    issued: dict[str, Any] = {}

    def issuer() -> None:
        issued["token"] = _next(engine)
        issued["at"] = time.monotonic()

    def second_write(writer: Any) -> None:
        # still inside the fenced transaction: a second write is fenced too
        assert _fenced_update(writer, pk, old, "unknown", "dispatching") == 1

    committed_at = _waits_for_the_fence(
        engine, pk, old, ("dispatching", "pending"), issuer, "next_fence_token", second_write
    )
    assert issued["token"] == old + 1
    assert issued["at"] >= committed_at
    assert _row(engine, pk) == ("unknown", old)
    with pytest.raises(FencedOut):
        _write(engine, pk, old, "succeeded", "unknown")


def test_a_first_claim_issues_the_next_token_once_a_passed_fence_commits(engine: Engine) -> None:
    """The drain's first claim (fence_and_claim) is a newer token's upsert and a claim in one
    statement: it waits for an older holder's passed fence, and that holder is fenced out."""
    pk = _insert_tx(engine)
    old = _next(engine)
    claimed: dict[str, Any] = {}

    def first_claim() -> None:
        with engine.begin() as conn:
            claimed["claim"] = work.fence_and_claim(conn, ACCOUNT, 10)
        claimed["at"] = time.monotonic()

    # the older holder's fenced write passed and holds the fence row (FOR SHARE)
    committed_at = _waits_for_the_fence(
        engine, pk, old, ("pending", "pending"), first_claim, "the first claim"
    )
    claim = claimed["claim"]
    assert claimed["at"] >= committed_at
    assert claim.fence_token == old + 1 and _current(engine, ACCOUNT) == old + 1
    assert [(i.id, i.status.value) for i in claim] == [(pk, "dispatching")]
    assert _row(engine, pk) == ("dispatching", old + 1)
    # the older holder comes back: refused, the row keeps the newer holder's claim
    with pytest.raises(FencedOut):
        _write(engine, pk, old, "succeeded", "dispatching")
    assert _row(engine, pk) == ("dispatching", old + 1)
    # and a new account's first claim starts its tokens at 1, with nothing to claim
    with engine.begin() as conn:
        empty = work.fence_and_claim(conn, "acct-new", 10)
    assert empty == [] and empty.fence_token == 1 and not empty.more_due
