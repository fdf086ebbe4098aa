"""SQLAlchemy engines: the service's pooled engine, and the fencing upsert's small one.

Built by :class:`~payment_worker.runtime.Runtime`, once per process; never cached here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, create_engine


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """A pooled engine for ``url`` (a SQLAlchemy URL)."""
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size * 2,
        pool_pre_ping=True,
        pool_recycle=1800,
        connect_args={"connect_timeout": 10},
    )


def make_fence_engine(url: str) -> Engine:
    """A small autocommit pool without pre-ping, for the fencing upsert of each lock
    acquisition: exactly one round trip (a pre-ping is one more, BEGIN/COMMIT two more). A
    dead pooled connection is retried once by the lock."""
    return create_engine(
        url,
        pool_size=2,
        max_overflow=8,
        pool_pre_ping=False,
        pool_recycle=1800,
        isolation_level="AUTOCOMMIT",
        connect_args={"connect_timeout": 10},
    )


@contextmanager
def transaction(engine: Engine) -> Iterator[Connection]:
    """One short database transaction: commit on success, roll back on error."""
    with engine.begin() as conn:
        yield conn
