"""Creating the service's database on a fresh server (the embedded PostgreSQL).

Plain psycopg in autocommit, not the SQLAlchemy engine: ``CREATE DATABASE`` cannot run in a
transaction, and the engine's URL names the database that may not exist yet.
"""

from __future__ import annotations


def ensure_database(admin_url: str, name: str) -> None:
    """Create the database ``name`` unless it exists.

    ``admin_url`` (libpq form) points at a database that always exists, e.g. ``postgres``.
    ``name`` is a fixed identifier of ours, never input: it is quoted, not escaped.
    """
    import psycopg

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
