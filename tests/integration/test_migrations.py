from __future__ import annotations

import subprocess
import sys
import threading
import time

import psycopg
import pytest

from payment_worker.db import migrate
from tests.conftest import PwEnv, wait_until


def _tables(conn: psycopg.Connection) -> set[str]:  # type: ignore[type-arg]
    rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {r[0] for r in rows}


EXPECTED = {"batches", "transactions", "idempotency_keys", "account_fences", "dead_letters"}
_HEAD = "0009"


def test_upgrade_twice_then_downgrade_and_up(pw_env: PwEnv, db_conn: psycopg.Connection) -> None:  # type: ignore[type-arg]
    assert _tables(db_conn) >= EXPECTED
    # the CLI: a second upgrade is a no-op
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-m", "payment_worker.cli", "db", "upgrade"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
    assert _tables(db_conn) >= EXPECTED
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate.downgrade(url, "base")
    assert not (EXPECTED & _tables(db_conn))
    migrate.upgrade(url)
    assert _tables(db_conn) >= EXPECTED


def test_constraints(db_conn: psycopg.Connection) -> None:  # type: ignore[type-arg]
    db_conn.execute(
        "INSERT INTO batches (batch_id, account_id, fingerprint, item_count) "
        "VALUES ('b1', 'a1', 'f', 1)"
    )
    bpk = db_conn.execute("SELECT id FROM batches").fetchone()[0]  # type: ignore[index]
    ins = (
        "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency, "
        "beneficiary, idempotency_key, status) VALUES (%s, 'a1', %s, %s, 'IDR', '{}', %s, %s)"
    )
    db_conn.execute(ins, (bpk, "t1", 10, "k1", "pending"))
    for args in [
        (bpk, "t1", 10, "k2", "pending"),  # (account, transaction) twice
        (bpk, "t2", 0, "k3", "pending"),  # amount must be > 0
        (bpk, "t3", 10, "k1", "pending"),  # idempotency key twice
        (bpk, "t4", 10, "k4", "paid"),  # not a state of the machine
    ]:
        try:
            with db_conn.transaction():
                db_conn.execute(ins, args)
        except psycopg.errors.IntegrityError:
            continue
        raise AssertionError(f"accepted {args}")


def test_models_match_the_migrations(pw_env: PwEnv) -> None:
    """The SQLAlchemy tables and the alembic head describe the same schema."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from payment_worker import runtime
    from payment_worker.db.models import metadata

    with runtime.current().engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_0006_dates_the_doubt_of_items_dead_in_doubt_before_0003(
    pw_env: PwEnv,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """Items already dead in doubt when 0003 ran kept no ``doubt_since`` and read as never in
    doubt (replayable at any age); 0006 dates them from their row. An item dead with nothing
    in doubt stays undated."""
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate.downgrade(url, "0005")
    db_conn.execute(
        "INSERT INTO batches (batch_id, account_id, fingerprint, status, item_count)"
        " VALUES ('mig6', 'acct-mig6', 'fp', 'completed', 3)"
    )
    for tx, reason, key in (
        ("unresolved", "unknown_unresolved", "sent"),
        ("key-sent", "retries_exhausted", "sent"),
        ("never", "retries_exhausted", "not_applied"),
    ):
        db_conn.execute(
            "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,"
            " beneficiary, idempotency_key, status, created_at)"
            " SELECT id, 'acct-mig6', %(tx)s, 100, 'IDR', '{}', 'k-' || %(tx)s, 'dead',"
            "  now() - interval '3 days' FROM batches WHERE batch_id = 'mig6'",
            {"tx": tx},
        )
        db_conn.execute(
            "INSERT INTO idempotency_keys (key, transaction_pk, request_fingerprint, status)"
            " SELECT idempotency_key, id, 'fp', %(key)s FROM transactions"
            " WHERE transaction_id = %(tx)s",
            {"tx": tx, "key": key},
        )
        db_conn.execute(
            "INSERT INTO dead_letters (transaction_pk, batch_pk, reason, attempts, payload)"
            " SELECT id, batch_pk, %(reason)s, 1, '{}' FROM transactions"
            " WHERE transaction_id = %(tx)s",
            {"tx": tx, "reason": reason},
        )
    migrate.upgrade(url)
    rows = db_conn.execute(
        "SELECT transaction_id, doubt_since = created_at, doubt_since IS NULL"
        " FROM transactions WHERE batch_pk = (SELECT id FROM batches WHERE batch_id = 'mig6')"
    ).fetchall()
    assert {r[0]: (r[1], r[2]) for r in rows} == {
        "unresolved": (True, False),
        "key-sent": (True, False),
        "never": (None, True),
    }


def test_0008_dates_the_doubt_of_dead_items_that_were_ever_looked_up(
    pw_env: PwEnv,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """Before 0003 a 404 ended the doubt at any age: an item looked up, then resent or out of
    attempts, died with its key "not_applied" and no doubt_since, replayable at any age to a
    404 and a second payment. 0008 dates every dead item that was ever looked up; one never
    looked up (all its sends answered "not applied") stays undated."""
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate.downgrade(url, "0007")
    db_conn.execute(
        "INSERT INTO batches (batch_id, account_id, fingerprint, status, item_count)"
        " VALUES ('mig8', 'acct-mig8', 'fp', 'completed', 3)"
    )
    for tx, status, lookups in (
        ("looked-up", "dead", 2),
        ("never", "dead", 0),
        ("paid", "succeeded", 1),
    ):
        db_conn.execute(
            "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,"
            " beneficiary, idempotency_key, status, lookups, created_at)"
            " SELECT id, 'acct-mig8', %(tx)s, 100, 'IDR', '{}', 'k-' || %(tx)s, %(status)s,"
            "  %(lookups)s, now() - interval '3 days' FROM batches WHERE batch_id = 'mig8'",
            {"tx": tx, "status": status, "lookups": lookups},
        )
    migrate.upgrade(url)
    rows = db_conn.execute(
        "SELECT transaction_id, doubt_since = created_at, doubt_since IS NULL"
        " FROM transactions WHERE batch_pk = (SELECT id FROM batches WHERE batch_id = 'mig8')"
    ).fetchall()
    assert {r[0]: (r[1], r[2]) for r in rows} == {
        "looked-up": (True, False),
        "never": (None, True),
        "paid": (None, True),
    }


def test_0009_dates_the_first_doubt_of_open_items_and_allows_a_key_in_conflict(
    pw_env: PwEnv,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """0009 keeps the first send ever in doubt (a 404 clears doubt_since, but that send may
    land after it): an open or dead item ever looked up is dated from its creation (its
    doubt now may be a later one, a review found a replay let through by it), one in doubt
    never looked up from its doubt; one never in doubt stays undated. Its down migration
    turns a key "conflict" into "sent" (maybe applied)."""
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate.downgrade(url, "0008")
    db_conn.execute(
        "INSERT INTO batches (batch_id, account_id, fingerprint, status, item_count)"
        " VALUES ('mig9', 'acct-mig9', 'fp', 'processing', 6)"
    )
    for tx, status, lookups, doubt in (
        ("in-doubt", "unknown", 0, "1 hour"),
        ("looked-up", "unknown", 2, "1 hour"),
        ("dead-looked-up", "dead", 2, "1 minute"),
        ("cleared", "retryable", 2, None),
        ("never", "retryable", 0, None),
        ("done", "succeeded", 1, None),
    ):
        db_conn.execute(
            "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,"
            " beneficiary, idempotency_key, status, attempts, lookups, created_at, doubt_since)"
            " SELECT id, 'acct-mig9', %(tx)s, 100, 'IDR', '{}', 'k-' || %(tx)s, %(status)s,"
            "  1, %(lookups)s, now() - interval '3 days', now() - CAST(%(doubt)s AS interval)"
            " FROM batches WHERE batch_id = 'mig9'",
            {"tx": tx, "status": status, "lookups": lookups, "doubt": doubt},
        )
    db_conn.execute(
        "INSERT INTO dead_letters (transaction_pk, batch_pk, reason)"
        " SELECT id, batch_pk, 'unknown_unresolved' FROM transactions"
        " WHERE transaction_id = 'dead-looked-up'"
    )
    migrate.upgrade(url)
    rows = db_conn.execute(
        "SELECT transaction_id, first_doubt_at = doubt_since, first_doubt_at = created_at,"
        " first_doubt_at IS NULL"
        " FROM transactions WHERE batch_pk = (SELECT id FROM batches WHERE batch_id = 'mig9')"
    ).fetchall()
    assert {r[0]: tuple(r[1:]) for r in rows} == {
        "in-doubt": (True, False, False),
        "looked-up": (False, True, False),
        "dead-looked-up": (False, True, False),  # a dlq replay is refused past the trust
        "cleared": (None, True, False),
        "never": (None, None, True),
        "done": (None, None, True),  # a terminal row: a replay dates it (DOUBT_SINCE)
    }
    db_conn.execute(
        "INSERT INTO idempotency_keys (key, transaction_pk, request_fingerprint, status)"
        " SELECT idempotency_key, id, 'fp', 'conflict' FROM transactions"
        " WHERE transaction_id = 'in-doubt'"
    )
    migrate.downgrade(url, "0008")
    status = db_conn.execute("SELECT status FROM idempotency_keys WHERE key = 'k-in-doubt'")
    assert status.fetchone() == ("sent",)
    migrate.upgrade(url)


def test_two_upgrades_at_once_take_turns(pw_env: PwEnv, db_conn: psycopg.Connection) -> None:  # type: ignore[type-arg]
    """Two deploy hosts run ``db upgrade`` on an empty database at the same moment: both end
    well and the schema is at head once (without the advisory lock, the second's CREATE
    TABLE met the first's and failed on a duplicate). Processes, as on two hosts: alembic's
    ``context`` is one per process. The test holds the migrators' lock until both wait for
    it, so that they start together, not by luck."""
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate.downgrade(url, "base")
    with psycopg.connect(pw_env.database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (migrate.ADVISORY_LOCK_KEY,))
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "payment_worker.cli", "db", "upgrade"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]

        def waiting() -> int:
            row = holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchone()
            return int(row[0]) if row else 0

        wait_until(lambda: waiting() == 2, 60, "both migrators waiting for the lock")
        holder.execute("SELECT pg_advisory_unlock(%s)", (migrate.ADVISORY_LOCK_KEY,))
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert _tables(db_conn) >= EXPECTED
    heads = db_conn.execute("SELECT version_num FROM alembic_version").fetchall()
    assert heads == [(_HEAD,)]


def test_a_migration_waits_for_a_table_lock_a_bounded_time_and_tries_again(
    pw_env: PwEnv,
    db_conn: psycopg.Connection,  # type: ignore[type-arg]
) -> None:
    """A long transaction reads ``transactions`` while 0005 (a DROP INDEX: an exclusive lock
    on the table) is to run. Every statement on that table queues behind a migration that
    waits for its lock, so the migration waits at most MIGRATION_LOCK_TIMEOUT_MS at a time:
    a reader meanwhile waits no longer than that, not until the long transaction ends (4 s
    here). The migration rolls back whole, tries again, and is at head once the long
    transaction has ended; with too short a retry budget it stops with nothing changed."""
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate.downgrade(url, "0004")
    with psycopg.connect(pw_env.database_url) as blocker:
        blocker.execute("SELECT count(*) FROM transactions").fetchone()  # holds ACCESS SHARE
        with pytest.raises(migrate.MigrationLockTimeout, match="nothing was changed"):
            migrate.upgrade(url, lock_timeout_ms=200, retry_seconds=0.5)
        version = db_conn.execute("SELECT version_num FROM alembic_version").fetchone()
        assert version == ("0004",)

        done = threading.Event()
        failed: list[BaseException] = []

        def upgrade() -> None:
            try:
                migrate.upgrade(url, lock_timeout_ms=200, retry_seconds=60)
            except BaseException as exc:
                failed.append(exc)
            finally:
                done.set()

        upgrader = threading.Thread(target=upgrade)
        upgrader.start()
        waits: list[float] = []
        with psycopg.connect(pw_env.database_url, autocommit=True) as reader:
            ends = time.monotonic() + 4
            while time.monotonic() < ends:
                began = time.monotonic()
                reader.execute("SELECT count(*) FROM transactions").fetchone()
                waits.append(time.monotonic() - began)
                time.sleep(0.05)
        assert not done.is_set()  # it keeps trying while the long transaction lasts
        blocker.rollback()
    upgrader.join(timeout=120)
    assert failed == []
    # at most one lock timeout's wait (200 ms) behind the migration, with room for a slow
    # host; the long transaction itself lasted 4 s
    assert max(waits) < 1.5, sorted(waits)[-5:]
    version = db_conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert version == (_HEAD,)
