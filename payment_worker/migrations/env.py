"""Alembic environment: the URL comes from the service settings (or the embedded server)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

from payment_worker.db.migrate import ADVISORY_LOCK_KEY
from payment_worker.db.models import metadata
from payment_worker.runtime import ServiceUrls
from payment_worker.settings import load_settings

config = context.config
target_metadata = metadata


def _url() -> str:
    # payment-worker db upgrade passes the URL; `alembic` run by hand reads the settings
    return config.attributes.get("url") or ServiceUrls.resolve(load_settings()).sqlalchemy


def _lock_timeout_ms() -> int:
    got = config.attributes.get("lock_timeout_ms")
    return int(got) if got is not None else load_settings().migration_lock_timeout_ms


def _guards() -> list[str]:
    """What a run does first, in its one transaction (alembic's default: a run that gives up
    leaves nothing half-applied); nothing for a run that only reads (``db current``)."""
    if config.attributes.get("read_only"):
        return []
    return [
        # one migrator at a time (two deploy hosts at once): the second waits here, then
        # reads the version the first committed. No bound on this wait: it queues no drain
        "SET LOCAL lock_timeout = 0",
        f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK_KEY})",
        # a table lock this run waits for queues every statement on that table behind it
        # (the drains'): bounded, and db/migrate.py tries the run again later
        f"SET LOCAL lock_timeout = {_lock_timeout_ms()}",
    ]


def run_migrations_offline() -> None:
    # `alembic upgrade --sql`: the script a person runs carries the same guards
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        for statement in _guards():
            context.execute(statement)
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            for statement in _guards():
                connection.execute(text(statement))
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
