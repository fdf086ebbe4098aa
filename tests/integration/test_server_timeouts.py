"""The server's own statement and lock timeouts, read as a worker behind PgBouncer reads them
(docs/configuration.md, "Behind PgBouncer"): real PostgreSQL, database-level settings."""

from __future__ import annotations

import psycopg
from psycopg.conninfo import conninfo_to_dict

from payment_worker.db.engine import (
    ConnectionLimits,
    LooseTimeout,
    loose_server_timeouts,
    make_engine,
)
from tests.conftest import PwEnv

WANTED = ConnectionLimits(statement_timeout_ms=30_000, lock_timeout_ms=10_000)


def _loose(pw_env: PwEnv, limits: ConnectionLimits = WANTED) -> list[LooseTimeout]:
    # pgbouncer=True: nothing sent at connect, so the session has the server's values
    engine = make_engine(
        pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1),
        pool_size=1,
        pgbouncer=True,
    )
    try:
        with engine.connect() as conn:
            return loose_server_timeouts(conn, limits)
    finally:
        engine.dispose()


def _set(pw_env: PwEnv, **values: str) -> None:
    dbname = str(conninfo_to_dict(pw_env.database_url)["dbname"])
    with psycopg.connect(pw_env.database_url, autocommit=True) as conn:
        for name, value in values.items():
            conn.execute(f"ALTER DATABASE \"{dbname}\" SET {name} = '{value}'")


def test_no_server_timeout_is_loose_against_every_wanted_one(pw_env: PwEnv) -> None:
    assert _loose(pw_env) == [
        LooseTimeout("lock_timeout", 0, 10_000),
        LooseTimeout("statement_timeout", 0, 30_000),
    ]


def test_a_larger_server_timeout_is_loose_an_equal_or_tighter_one_is_not(pw_env: PwEnv) -> None:
    _set(pw_env, statement_timeout="30s", lock_timeout="1min")
    assert _loose(pw_env) == [LooseTimeout("lock_timeout", 60_000, 10_000)]
    _set(pw_env, lock_timeout="5s")
    assert _loose(pw_env) == []


def test_a_timeout_the_settings_turn_off_is_never_loose(pw_env: PwEnv) -> None:
    assert _loose(pw_env, ConnectionLimits(statement_timeout_ms=0, lock_timeout_ms=0)) == []
