"""The drain's statements on the pool's psycopg connection (payment_worker/db/driver.py): the
pool gets every connection back as it lent it, errors are SQLAlchemy's as before, and a
connection that broke under a statement is dropped with its generation."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy
from sqlalchemy import text

from payment_worker.db.driver import Statement, checked_out, fetch
from payment_worker.db.engine import make_engine
from payment_worker.db.retry import transient_reason
from payment_worker.db.work_store import PgWorkStore
from payment_worker.errors import FencedOut
from tests.conftest import PwEnv

APP = "pw-driver-test"


@pytest.fixture
def engine_of(pw_env: PwEnv) -> Iterator[Callable[[int], sqlalchemy.Engine]]:
    """Builds an engine with a pool of the given size on the test's database; each is
    disposed when the test ends."""
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    made: list[sqlalchemy.Engine] = []

    def build(pool_size: int) -> sqlalchemy.Engine:
        made.append(make_engine(url, pool_size=pool_size, pool_timeout=2.0, application_name=APP))
        return made[-1]

    yield build
    for engine in made:
        engine.dispose()


def _autocommit_of_the_pooled_connection(engine: sqlalchemy.Engine) -> bool:
    fairy = engine.raw_connection()
    try:
        return bool(fairy.driver_connection.autocommit)  # type: ignore[union-attr]
    finally:
        fairy.close()


def test_a_statement_gives_its_connection_back_as_it_was_lent(
    engine_of: Callable[[int], sqlalchemy.Engine],
) -> None:
    engine = engine_of(1)
    store = PgWorkStore(engine)
    token = store.fence_and_claim("acct-drv", 5).fence_token
    assert token == 1
    assert not _autocommit_of_the_pooled_connection(engine)
    # a stale token: FencedOut, raised inside the checkout
    with pytest.raises(FencedOut):
        store.claim_due("acct-drv", token - 1, 5)
    assert not _autocommit_of_the_pooled_connection(engine)
    # a statement the server refuses: SQLAlchemy's error around psycopg's, as a statement
    # run through SQLAlchemy raises it, and the connection stays in the pool, usable
    with pytest.raises(sqlalchemy.exc.DBAPIError) as caught:
        store.claim_due("acct-drv", token, -5)  # LIMIT -4
    assert isinstance(caught.value.orig, psycopg.errors.InvalidRowCountInLimitClause)
    assert not caught.value.connection_invalidated
    assert transient_reason(caught.value) is None
    assert not _autocommit_of_the_pooled_connection(engine)
    # and a transaction on that connection is one: what it wrote is rolled back
    with engine.connect() as conn:
        conn.execute(
            text("UPDATE account_fences SET fence_token = 99 WHERE account_id = 'acct-drv'")
        )
        conn.rollback()
    assert store.claim_due("acct-drv", token, 5) == []
    assert engine.pool.checkedout() == 0


def test_a_connection_killed_under_it_is_dropped_with_its_generation(
    pw_env: PwEnv, engine_of: Callable[[int], sqlalchemy.Engine]
) -> None:
    engine = engine_of(2)
    store = PgWorkStore(engine)
    # both connections opened and back in the pool
    first, second = engine.raw_connection(), engine.raw_connection()
    first.close()
    second.close()
    token = store.fence_and_claim("acct-drv", 5).fence_token
    assert token is not None
    with psycopg.connect(pw_env.database_url, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = %s",
            (APP,),
        ).fetchone()
    assert killed == (2,)
    with pytest.raises(sqlalchemy.exc.DBAPIError) as caught:
        store.claim_due("acct-drv", token, 5)
    assert caught.value.connection_invalidated
    assert transient_reason(caught.value) is not None  # the drain retries it
    # the other connection died with it and is not lent again: two statements at once
    # (both pooled connections lent) run on new connections
    with checked_out(engine) as one, checked_out(engine) as two:
        assert one.execute("SELECT 1").fetchone() == two.execute("SELECT 1").fetchone()
    assert store.claim_due("acct-drv", token, 5) == []
    assert engine.pool.checkedout() == 0


def test_the_pool_budget_holds_for_driver_statements(
    engine_of: Callable[[int], sqlalchemy.Engine],
) -> None:
    engine = engine_of(1)
    held = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with checked_out(engine):
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    # the one connection is lent: the next checkout waits pool_timeout, then fails as
    # SQLAlchemy's pool does (a transient error for the drain)
    with pytest.raises(sqlalchemy.exc.TimeoutError) as caught, checked_out(engine):
        pass
    assert transient_reason(caught.value) == "pool_timeout"
    done.set()
    holder.join(10)
    with checked_out(engine) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_both_connection_kinds_read_the_same_values(
    engine_of: Callable[[int], sqlalchemy.Engine],
) -> None:
    stmt = Statement.of(
        "SELECT CAST(:a AS text) AS a, CAST(:b AS jsonb) AS b, ARRAY[1, 2] AS c,"
        " now() - now() AS d, NULL AS e -- a comment the statement does not send"
    )
    params: dict[str, Any] = {"a": "x%y", "b": '{"k": [1, "v"]}'}
    engine = engine_of(1)
    with engine.connect() as conn:
        via_sqlalchemy = [dict(r) for r in fetch(conn, stmt, params)]
    with checked_out(engine) as driver:
        via_driver = [dict(r) for r in fetch(driver, stmt, params)]
        with pytest.raises(TypeError):
            fetch(driver, text("SELECT 1"), {})
    assert via_driver == via_sqlalchemy
    assert via_driver[0]["b"] == {"k": [1, "v"]} and via_driver[0]["c"] == [1, 2]
    assert "--" not in stmt.sql and "%(a)s" in stmt.sql


def _prepared(conn: psycopg.Connection[Any]) -> list[str]:
    rows = conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()
    return [str(r[0]) for r in rows]


@pytest.mark.parametrize("pgbouncer", [False, True])
def test_a_drain_statement_is_prepared_at_its_first_run_unless_behind_pgbouncer(
    pw_env: PwEnv, pgbouncer: bool
) -> None:
    """Prepared on its first run, not psycopg's sixth: a fresh worker's pooled connections
    stop planning the drain's statements early in its first burst. Behind PgBouncer in
    transaction mode nothing is ever prepared (the next transaction may get another server
    session, where the name does not exist)."""
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = make_engine(url, pool_size=1, application_name=APP, pgbouncer=pgbouncer)
    stmt = Statement.of("SELECT CAST(:a AS int) + 1 AS b -- the drain's kind of statement")
    try:
        with checked_out(engine) as conn:
            assert fetch(conn, stmt, {"a": 1}) == [{"b": 2}]
            prepared = _prepared(conn)
        expected = [] if pgbouncer else ["SELECT CAST($1 AS int) + 1 AS b"]
        assert [p for p in prepared if "+ 1 AS b" in p] == expected
        # the same connection runs it again on its prepared statement: nothing new prepared
        with checked_out(engine) as conn:
            assert fetch(conn, stmt, {"a": 2}) == [{"b": 3}]
            assert _prepared(conn) == prepared
    finally:
        engine.dispose()


def _backend_pid(engine: sqlalchemy.Engine) -> int:
    with checked_out(engine) as conn:
        return int(conn.info.backend_pid)


def test_a_drain_statement_prepared_before_a_migration_changed_its_columns_runs_again(
    engine_of: Callable[[int], sqlalchemy.Engine], db_conn: psycopg.Connection[Any]
) -> None:
    """A migration that changes the type of a column the claim returns, run while the worker
    holds the claim prepared: Postgres refuses that prepared statement on that connection for
    good. The refusal is transient (``plan_changed``, nothing ran) and the connection alone is
    dropped, so the retry prepares the statement afresh and the claim goes on."""
    engine = engine_of(2)
    store = PgWorkStore(engine)
    # a sibling connection, lent out meanwhile: the statements prepare on the other one
    sibling = engine.raw_connection()
    sibling_pid = sibling.driver_connection.info.backend_pid  # type: ignore[union-attr]
    assert store.fence_and_claim("acct-mig", 5).fence_token == 1  # both statements prepared
    assert store.claim_due("acct-mig", 1, 5) == []
    before = _backend_pid(engine)
    db_conn.execute("ALTER TABLE transactions ALTER COLUMN description TYPE varchar(500)")
    with pytest.raises(sqlalchemy.exc.DBAPIError) as refused:
        store.claim_due("acct-mig", 1, 5)
    assert transient_reason(refused.value) == "plan_changed"
    assert refused.value.connection_invalidated  # as through SQLAlchemy (the test below)
    assert store.claim_due("acct-mig", 1, 5) == []
    assert _backend_pid(engine) != before
    # only that connection went: the sibling is pooled still (not its generation's fate)
    sibling.close()
    lent = [engine.raw_connection() for _ in range(2)]
    try:
        pids = {c.driver_connection.info.backend_pid for c in lent}  # type: ignore[union-attr]
    finally:
        for c in lent:
            c.close()
    assert sibling_pid in pids and before not in pids


def test_a_sqlalchemy_statement_prepared_before_a_migration_drops_only_its_connection(
    engine_of: Callable[[int], sqlalchemy.Engine], db_conn: psycopg.Connection[Any]
) -> None:
    """The same through SQLAlchemy (the sweeper's and the tools' statements, which psycopg
    prepares at their sixth run on a connection): the refusal counts as a disconnect of that
    one connection, and the next statement runs on a fresh one."""
    db_conn.execute("CREATE TABLE pw_mig (id int PRIMARY KEY, a int NOT NULL)")
    db_conn.execute("INSERT INTO pw_mig VALUES (1, 0)")
    engine = engine_of(1)
    bump = text("UPDATE pw_mig SET a = a + 1 WHERE id = 1 RETURNING a")
    with engine.connect() as conn:
        for _ in range(6):  # prepared at the sixth (psycopg's prepare_threshold, 5)
            conn.execute(bump)
        conn.commit()
        before = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
    db_conn.execute("ALTER TABLE pw_mig ALTER COLUMN a TYPE bigint")
    with engine.connect() as conn, pytest.raises(sqlalchemy.exc.DBAPIError) as refused:
        conn.execute(bump)
    assert transient_reason(refused.value) == "plan_changed"
    assert refused.value.connection_invalidated
    with engine.connect() as conn:
        assert conn.execute(bump).scalar_one() == 7  # the refused one changed nothing
        conn.commit()
        after = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
    assert after != before
