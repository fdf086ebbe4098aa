"""Alembic environment: the URL comes from the service settings (or the embedded server)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from payment_worker.db.models import metadata
from payment_worker.runtime import ServiceUrls
from payment_worker.settings import load_settings

config = context.config
target_metadata = metadata


def _url() -> str:
    # payment-worker db upgrade passes the URL; `alembic` run by hand reads the settings
    return config.attributes.get("url") or ServiceUrls.resolve(load_settings()).sqlalchemy


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
