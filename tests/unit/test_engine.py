"""The connection limits every engine of the Runtime starts with (db/engine.py), no server."""

from __future__ import annotations

from sqlalchemy.pool import QueuePool

from payment_worker.db.engine import ConnectionLimits, application_name, autocommit, make_engine
from payment_worker.settings import Settings

URL = "postgresql+psycopg://u@db.example:5432/pw"


def test_the_settings_become_libpq_parameters() -> None:
    limits = ConnectionLimits.from_settings(Settings())
    assert limits.connect_args(URL) == {
        "connect_timeout": 10,
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
        "tcp_user_timeout": 60000,
        # at connect time, never a session SET (a transaction pooler would leak it)
        "options": "-c statement_timeout=30000 -c lock_timeout=10000 -c jit=off",
    }


def test_options_of_the_url_are_kept_and_zero_is_not_sent() -> None:
    limits = ConnectionLimits(statement_timeout_ms=500, lock_timeout_ms=0, tcp_user_timeout_ms=0)
    args = limits.connect_args(URL + "?options=-c%20search_path%3Dpw")
    assert args["options"] == "-c search_path=pw -c statement_timeout=500 -c jit=off"
    assert "tcp_user_timeout" not in args
    # no timeout to send: the server's (or the role's) values hold; JIT is off all the same
    assert ConnectionLimits().connect_args(URL)["options"] == "-c jit=off"


def test_jit_is_off_unless_the_url_says_otherwise() -> None:
    # short statements only: JIT compilation would cost more than it saves (a sweeper query
    # above jit_above_cost compiled for 1.7 s on a server with LLVM)
    args = ConnectionLimits().connect_args(URL + "?options=-c%20jit%3Don")
    assert "options" not in args  # the URL's own options reach libpq unchanged
    args = ConnectionLimits(statement_timeout_ms=500).connect_args(URL + "?options=-c%20jit%3Don")
    assert args["options"] == "-c jit=on -c statement_timeout=500"


def test_every_setting_is_read() -> None:
    s = Settings(
        db_statement_timeout_ms=1234,
        db_lock_timeout_ms=99,
        db_keepalives_idle=7,
        db_keepalives_interval=3,
        db_keepalives_count=2,
        db_tcp_user_timeout_ms=5000,
    )
    assert ConnectionLimits.from_settings(s) == ConnectionLimits(1234, 99, 7, 3, 2, 5000)


def test_each_process_names_its_connections() -> None:
    args = ConnectionLimits().connect_args(URL, application_name=application_name(4242, "host-a"))
    assert args["application_name"] == "payment-worker:4242@host-a"
    # a long host name is cut, never the pid; the server keeps 63 bytes
    assert application_name(7, "h" * 100).startswith("payment-worker:7@")
    assert len(application_name(7, "h" * 100)) == 63
    # a name in the URL wins
    named = ConnectionLimits().connect_args(URL + "?application_name=ops", application_name="x")
    assert "application_name" not in named


def test_behind_pgbouncer_no_startup_options_and_no_prepared_statements() -> None:
    limits = ConnectionLimits.from_settings(Settings())
    args = limits.connect_args(URL, pgbouncer=True)
    # PgBouncer 1.18 refuses the startup parameter "options"; the role carries the timeouts
    # (and jit = off)
    assert "options" not in args
    assert args["prepare_threshold"] is None
    assert "prepare_threshold" not in limits.connect_args(URL)


def test_the_pool_is_bounded_by_its_size_with_no_overflow() -> None:
    engine = make_engine(URL, pool_size=7, pool_timeout=2.5)
    pool = engine.pool
    assert isinstance(pool, QueuePool)
    assert pool.size() == 7 and pool._max_overflow == 0 and pool._timeout == 2.5
    assert not pool._pre_ping  # a ping per checkout would double the drain's round trips
    # the autocommit view shares the pool: one budget per process
    assert autocommit(engine).pool is pool
    engine.dispose()
