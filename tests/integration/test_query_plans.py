"""The drain's statements read one account's rows through indexes, whatever the statistics.

A table that just grew (a fresh deployment, a burst of submissions) is planned on the
statistics of when it was small until autovacuum analyzes it again. The drain's last
statement once ran there as a sequential scan of every transaction (30 ms a statement at
10,000 rows, the largest Postgres cost of a drain). These tests build that table in a fresh
database, never analyzed, and read the plans PostgreSQL chooses for the real statements.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import text

from payment_worker.db import work
from payment_worker.db.fences import fence_params
from payment_worker.runtime import Runtime

pytestmark = pytest.mark.integration

ACCOUNTS = 2000
ITEMS = 5
ACCOUNT = "acct-1500"  # the accounts before it are done, those after it wait


def _fill(conn: sqlalchemy.Connection, first: int, last: int) -> None:
    """One batch of ITEMS pending items for each account ``first`` to ``last`` - 1, and
    their fences."""
    conn.execute(
        text("""
        INSERT INTO batches (batch_id, account_id, fingerprint, item_count)
        SELECT 'b-' || lpad(a::text, 4, '0'), 'acct-' || lpad(a::text, 4, '0'), 'f', :items
        FROM generate_series(:first, :last - 1) a
        """),
        {"first": first, "last": last, "items": ITEMS},
    )
    conn.execute(
        text("""
        INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,
                                  beneficiary, idempotency_key)
        SELECT b.id, b.account_id, 'tx-' || i, 100, 'EUR', '{}'::jsonb,
               b.account_id || '.tx-' || i
        FROM batches b, generate_series(1, :items) i
        WHERE b.id > coalesce((SELECT max(batch_pk) FROM transactions), 0)
        """),
        {"items": ITEMS},
    )
    conn.execute(
        text("""
        INSERT INTO idempotency_keys (key, transaction_pk, request_fingerprint)
        SELECT idempotency_key, id, 'f' FROM transactions
        ON CONFLICT DO NOTHING
        """)
    )
    conn.execute(
        text("""
        INSERT INTO account_fences (account_id, fence_token)
        SELECT account_id, 1 FROM batches ON CONFLICT DO NOTHING
        """)
    )


def _plan(conn: sqlalchemy.Connection, statement: sqlalchemy.TextClause, params: Any) -> str:
    """The plan PostgreSQL chooses for ``statement`` (EXPLAIN: nothing is executed)."""
    rows = conn.execute(text("EXPLAIN " + statement.text), params).scalars().all()
    return "\n".join(rows)


@pytest.fixture(params=["never analyzed", "analyzed when small"])
def filled(rt: Runtime, request: pytest.FixtureRequest) -> sqlalchemy.Engine:
    """ACCOUNTS accounts, most of them done: a table that grew since it was last analyzed
    (never, or when it held a handful of rows)."""
    with rt.engine.begin() as conn:
        if request.param == "analyzed when small":
            _fill(conn, 0, 10)
            conn.execute(text("ANALYZE batches, transactions"))
            _fill(conn, 10, ACCOUNTS)
        else:
            _fill(conn, 0, ACCOUNTS)
        # the accounts before ours are done, as in the middle of a large load
        for table, status in (("transactions", "succeeded"), ("batches", "completed")):
            conn.execute(
                text(f"UPDATE {table} SET status = '{status}' WHERE account_id < :a"),
                {"a": ACCOUNT},
            )
    return rt.engine


def test_the_drains_last_statement_reads_only_the_accounts_rows(filled: sqlalchemy.Engine) -> None:
    with filled.connect() as conn:
        ids = (
            conn.execute(text("SELECT id FROM transactions WHERE account_id = :a"), {"a": ACCOUNT})
            .scalars()
            .all()
        )
        rows = json.dumps(
            [
                {
                    "id": i,
                    "status": "succeeded",
                    "attempts": 1,
                    "lookups": 0,
                    "delay": 0.0,
                    "doubt": "keep",
                }
                for i in ids
            ]
        )
        params = {"rows": rows, **fence_params(ACCOUNT, 1)}
        plans = {
            "record_and_finish": _plan(conn, work._RECORD_AND_FINISH, params),
            "complete_and_next_due": _plan(
                conn, work._COMPLETE_AND_NEXT_DUE, {"pks": None, **fence_params(ACCOUNT, 1)}
            ),
            "claim": _plan(conn, work._CLAIM, {"n": 50, **fence_params(ACCOUNT, 1)}),
        }
    for name, plan in plans.items():
        assert "Seq Scan on transactions" not in plan, f"{name}:\n{plan}"


def test_the_statements_still_do_their_work_on_that_table(filled: sqlalchemy.Engine) -> None:
    """The same statements, run: the account's batch completes, nobody else's changes."""
    with filled.connect() as conn:
        claim = work.claim_due(conn, ACCOUNT, 1, 50)
        assert len(claim) == ITEMS and not claim.more_due
        from payment_worker.domain.statuses import KeyStatus, TxStatus
        from payment_worker.domain.transitions import Decision, ItemOutcome

        outcomes = [
            ItemOutcome(
                i.id,
                i.attempts,
                i.lookups,
                Decision(TxStatus.SUCCEEDED, payment_id=f"p{i.id}", key_status=KeyStatus.APPLIED),
            )
            for i in claim
        ]
        updated, completed, wait = work.record_and_finish(conn, ACCOUNT, 1, outcomes)
        assert (updated, completed, wait) == (ITEMS, ["b-1500"], None)
        counts = conn.execute(
            text("SELECT status, count(*) FROM batches GROUP BY status ORDER BY status")
        ).all()
        assert [tuple(r) for r in counts] == [("completed", 1501), ("pending", ACCOUNTS - 1501)]
