"""The drain's and the sweeper's statements read one account's (or batch's) rows through
indexes, whatever the statistics.

A table whose contents changed since it was last analyzed (a fresh deployment, a burst of
submissions after a quiet night) is planned on old statistics until autovacuum analyzes it
again. There the drain's last statement ran as a sequential scan of every transaction (30 ms
a statement at 10,000 rows), the claim scanned every open item through an index on status,
and the sweeper's uncompleted-batch query scanned that whole index once per open batch (19 s
a pass). The updates of ``batches`` that chose a batch by its id and status scanned every
open batch on statistics that said all were completed (44 ms a statement at 100,000 open
batches), and the closing of a replayed item's dead letter every open letter on statistics
that said none was open. These tests build such tables in a fresh database and read the
plans PostgreSQL chooses for the real statements (EXPLAIN, JSON): both the plan for the
given parameters and the generic plan, which a pooled connection runs once it has prepared
a statement and Postgres finds the generic plan no costlier.
"""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg.sql
import pytest
import sqlalchemy
from sqlalchemy import TextClause, text

from payment_worker.db import stalls, work
from payment_worker.db.driver import Statement
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


def _plan(conn: sqlalchemy.Connection, statement: Statement | TextClause, params: Any) -> Any:
    """The plan PostgreSQL chooses for ``statement`` and these parameters (EXPLAIN: nothing
    is executed)."""
    clause = statement.clause if isinstance(statement, Statement) else statement
    return conn.execute(text("EXPLAIN (FORMAT JSON) " + clause.text), params).scalar_one()


def _generic_plan(
    conn: sqlalchemy.Connection, statement: Statement | TextClause, params: Any
) -> Any:
    """The plan PostgreSQL keeps for ``statement`` prepared, whatever the parameters: the
    generic plan. Every statement is prepared on a pooled connection (the drain's at their
    first run, the others after psycopg's threshold of five), and after five plans for their
    parameters Postgres runs the generic one wherever it estimates it no costlier; so it must
    be bounded too. (EXPLAIN EXECUTE under ``force_generic_plan``: nothing is executed.)"""
    sql = statement.sql if isinstance(statement, Statement) else Statement.of(statement.text).sql
    names: list[str] = []

    def numbered(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", numbered, sql).replace("%%", "%")
    driver = conn.connection.driver_connection
    assert driver is not None
    types = ", ".join(_PARAM_TYPES[n] for n in names)
    driver.execute("SET plan_cache_mode = force_generic_plan")
    driver.execute(f"PREPARE pw_plan_check ({types}) AS {prepared}")
    try:
        # EXPLAIN takes no bound parameters: the values as literals (the plan is generic)
        args = psycopg.sql.SQL(", ").join(psycopg.sql.Literal(params[n]) for n in names)
        query = psycopg.sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE pw_plan_check({})").format(args)
        row = driver.execute(query).fetchone()
        assert row is not None
        return row[0]
    finally:
        driver.execute("DEALLOCATE pw_plan_check")
        driver.execute("RESET plan_cache_mode")


# the statements' parameters, typed as their columns (a generic plan is planned for types,
# not values)
_PARAM_TYPES = {
    "acct": "text",
    "tok": "bigint",
    "n": "int",
    "rows": "text",
    "pks": "bigint[]",
    "accts": "text[]",
    "stale": "float8",
    "limit": "int",
    "every": "boolean",
}


def _plans(
    conn: sqlalchemy.Connection, statement: Statement | TextClause, params: Any
) -> dict[str, Any]:
    """Both plans a pooled connection may run for ``statement``: for these parameters and
    the generic one."""
    return {
        "custom": _plan(conn, statement, params),
        "generic": _generic_plan(conn, statement, params),
    }


_SCANS = ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Index Scan")


def _succeeded_rows(conn: sqlalchemy.Connection) -> str:
    """The record statements' ``rows`` parameter: every item of ACCOUNT succeeded."""
    ids = (
        conn.execute(text("SELECT id FROM transactions WHERE account_id = :a"), {"a": ACCOUNT})
        .scalars()
        .all()
    )
    return json.dumps(
        [{"id": i, "status": "succeeded", "attempts": 1, "lookups": 0, "delay": 0.0} for i in ids]
    )


# what bounds a read of each table the drain's statements touch: an index condition on the
# account, a batch or a row (a condition on status alone reads every open item, or batch, of
# every account)
_BOUNDS = {
    "transactions": ("account_id", "batch_pk", "(id ="),
    "batches": ("account_id", "batch_id", "(id ="),
    "dead_letters": ("transaction_pk",),
    "idempotency_keys": ("transaction_pk", "(key ="),
    "account_fences": ("account_id",),
}


def _unbounded_reads(plan: Any, table: str = "transactions") -> list[str]:
    """The reads of ``table`` in ``plan`` not bounded by an index condition on the account,
    a batch or a row: a sequential scan, an index scanned from end to end with a filter, or
    one searched by status only."""
    found = []
    stack = [plan[0]["Plan"]]
    while stack:
        node = stack.pop()
        stack.extend(node.get("Plans", []))
        kind = node["Node Type"]
        index = str(node.get("Index Name", ""))
        on_table = node.get("Relation Name") == table or index.startswith(f"{table}_")
        if not on_table or kind not in _SCANS:
            continue  # a bitmap heap scan reads what its bitmap index scans found
        cond = str(node.get("Index Cond", ""))
        if not any(column in cond for column in _BOUNDS[table]):
            found.append(f"{kind} {node.get('Index Name', '')} {cond}".strip())
    return found


@pytest.fixture(params=["never analyzed", "analyzed when small", "analyzed when all done"])
def filled(rt: Runtime, request: pytest.FixtureRequest) -> sqlalchemy.Engine:
    """ACCOUNTS accounts, those before ACCOUNT done: a table whose statistics are older than
    its contents (never analyzed; analyzed when it held a handful of rows; analyzed when
    every item was done, before a burst of new work, as on a quiet system in the morning)."""
    with rt.engine.begin() as conn:
        if request.param == "analyzed when small":
            _fill(conn, 0, 10)
            conn.execute(text("ANALYZE batches, transactions"))
            _fill(conn, 10, ACCOUNTS)
        else:
            _fill(conn, 0, ACCOUNTS)
        done = {"transactions": "succeeded", "batches": "completed"}
        if request.param == "analyzed when all done":
            for table, status in done.items():
                conn.execute(text(f"UPDATE {table} SET status = '{status}'"))
            conn.execute(text("ANALYZE batches, transactions"))
            for table in done:
                conn.execute(
                    text(f"UPDATE {table} SET status = 'pending' WHERE account_id >= :a"),
                    {"a": ACCOUNT},
                )
        else:
            for table, status in done.items():
                conn.execute(
                    text(f"UPDATE {table} SET status = '{status}' WHERE account_id < :a"),
                    {"a": ACCOUNT},
                )
    return rt.engine


def test_the_drains_statements_read_only_the_accounts_rows(filled: sqlalchemy.Engine) -> None:
    """Every read of every table the statements touch goes through an index bounded by the
    account, a batch or a row: ``transactions``, ``batches`` (the claim marks a batch
    processing, the last statement completes it), ``dead_letters`` (the record statements
    close a replayed item's letter), ``idempotency_keys`` and ``account_fences``."""
    with filled.connect() as conn:
        rows = _succeeded_rows(conn)
        fence = fence_params(ACCOUNT, 1)
        plans = {
            "claim": _plans(conn, work._CLAIM, {"n": 50, **fence}),
            "fence_and_claim": _plans(conn, work._FENCE_AND_CLAIM, {"n": 50, "acct": ACCOUNT}),
            "record_outcomes": _plans(conn, work._RECORD, {"rows": rows, **fence}),
            "record_and_finish": _plans(conn, work._RECORD_AND_FINISH, {"rows": rows, **fence}),
            "record_and_claim": _plans(
                conn, work._RECORD_AND_CLAIM, {"rows": rows, "pks": [1], "n": 50, **fence}
            ),
            "complete_and_next_due": _plans(
                conn, work._COMPLETE_AND_NEXT_DUE, {"pks": None, **fence}
            ),
            "complete_batches": _plans(conn, work._COMPLETE, {"pks": None, **fence}),
            "still_stalled": _plans(
                conn, stalls._STILL_STALLED, {"accts": [ACCOUNT], "stale": 2.0}
            ),
        }
    for table in _BOUNDS:
        unbounded = {
            (name, kind): _unbounded_reads(plan, table)
            for name, both in plans.items()
            for kind, plan in both.items()
        }
        assert unbounded == {key: [] for key in unbounded}, table


def test_recording_outcomes_probes_only_the_items_dead_letters(rt: Runtime) -> None:
    """An incident's replay: statistics taken when every dead letter was resolved, then
    thousands open again (replayed, waiting for their items' outcome). Recording an outcome
    closes a replayed item's letter; it must find it by the item, not read every open
    letter (44 ms a statement at 100,000 open letters)."""
    with rt.engine.begin() as conn:
        _fill(conn, 0, ACCOUNTS)
        conn.execute(
            text("""
            INSERT INTO dead_letters (transaction_pk, batch_pk, reason, attempts,
                                      resolved_at, replay_count)
            SELECT id, batch_pk, 'retries_exhausted', 3, now(), 1 FROM transactions
            """)
        )
        conn.execute(text("ANALYZE dead_letters"))
        conn.execute(text("UPDATE dead_letters SET resolved_at = NULL"))
    with rt.engine.connect() as conn:
        rows = _succeeded_rows(conn)
        fence = fence_params(ACCOUNT, 1)
        plans = {
            "record_outcomes": _plans(conn, work._RECORD, {"rows": rows, **fence}),
            "record_and_finish": _plans(conn, work._RECORD_AND_FINISH, {"rows": rows, **fence}),
            "record_and_claim": _plans(
                conn, work._RECORD_AND_CLAIM, {"rows": rows, "pks": [1], "n": 50, **fence}
            ),
        }
    unbounded = {
        (name, kind): _unbounded_reads(plan, "dead_letters")
        for name, both in plans.items()
        for kind, plan in both.items()
    }
    assert unbounded == {key: [] for key in unbounded}


def test_the_sweepers_uncompleted_batch_query_probes_each_open_batch(
    filled: sqlalchemy.Engine,
) -> None:
    """Once per second, fleet-wide: one index probe per open batch, never a scan of every
    transaction (it ran 19 s a pass on stale statistics, its inner side a full index scan)."""
    with filled.connect() as conn:
        plans = _plans(conn, stalls._UNCOMPLETED, {"stale": 2.0, "limit": 500})
    assert {kind: _unbounded_reads(plan) for kind, plan in plans.items()} == {
        "custom": [],
        "generic": [],
    }


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
