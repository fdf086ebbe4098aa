"""One SQLAlchemy engine per process (fork-safe), and short transactions on it."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, create_engine

from payment_worker.services import sqlalchemy_url
from payment_worker.settings import Settings, get_settings

_lock = threading.Lock()
_engines: dict[tuple[int, str], Engine] = {}


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


def get_engine(settings: Settings | None = None) -> Engine:
    """The engine of this process; a forked child gets its own, never its parent's sockets."""
    url = sqlalchemy_url(settings or get_settings())
    key = (os.getpid(), url)
    engine = _engines.get(key)
    if engine is None:
        with _lock:
            engine = _engines.get(key)
            if engine is None:
                engine = make_engine(url)
                _engines[key] = engine
    return engine


def dispose_engines() -> None:
    """Forget every engine (after a fork, or at shutdown)."""
    with _lock:
        for (pid, _), engine in list(_engines.items()):
            # a parent's pooled sockets must not be closed from the child: close=False
            engine.dispose(close=pid == os.getpid())
        _engines.clear()


@contextmanager
def transaction(engine: Engine | None = None) -> Iterator[Connection]:
    """One short database transaction: commit on success, roll back on error."""
    with (engine or get_engine()).begin() as conn:
        yield conn
