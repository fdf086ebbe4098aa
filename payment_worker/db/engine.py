"""SQLAlchemy engines: the service's pooled engine, and the fencing upsert's small one.

Built by :class:`~payment_worker.runtime.Runtime`, once per process; never cached here.

Every connection of both engines starts with the service's :class:`ConnectionLimits`: a
``statement_timeout`` and a ``lock_timeout`` sent at connect time (libpq ``options``, so no
``SET`` round trip, and nothing a transaction-mode pooler would have to carry over from one
client to the next), and TCP keepalives plus a TCP user timeout, so that a statement blocked
on a lock, a server that stopped answering or a silently dropped network never holds a
worker (and its account lock) for ever.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from payment_worker.settings import Settings

CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What every connection of an engine starts with (``DB_*`` settings).

    A timeout of 0 is not sent at all: the server's (or the role's) own value then holds,
    which is how a deployment behind a transaction-mode PgBouncer sets them (see
    docs/configuration.md).
    """

    statement_timeout_ms: int = 0
    lock_timeout_ms: int = 0
    keepalives_idle: int = 30
    keepalives_interval: int = 10
    keepalives_count: int = 3
    tcp_user_timeout_ms: int = 0

    @classmethod
    def from_settings(cls, s: Settings) -> ConnectionLimits:
        """The limits of the settings (``DB_STATEMENT_TIMEOUT_MS`` and friends)."""
        return cls(
            statement_timeout_ms=s.db_statement_timeout_ms,
            lock_timeout_ms=s.db_lock_timeout_ms,
            keepalives_idle=s.db_keepalives_idle,
            keepalives_interval=s.db_keepalives_interval,
            keepalives_count=s.db_keepalives_count,
            tcp_user_timeout_ms=s.db_tcp_user_timeout_ms,
        )

    def connect_args(self, url: str) -> dict[str, Any]:
        """libpq connection parameters for an engine on ``url`` (SQLAlchemy form).

        Server settings go in libpq's ``options`` (``-c name=value``), appended to any
        ``options`` the URL already carries; keepalives and the TCP user timeout are
        ignored by libpq on a unix socket (the embedded server's), which needs none.
        """
        server = [
            f"-c {name}={value}"
            for name, value in (
                ("statement_timeout", self.statement_timeout_ms),
                ("lock_timeout", self.lock_timeout_ms),
            )
            if value > 0
        ]
        args: dict[str, Any] = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle,
            "keepalives_interval": self.keepalives_interval,
            "keepalives_count": self.keepalives_count,
        }
        if self.tcp_user_timeout_ms > 0:
            args["tcp_user_timeout"] = self.tcp_user_timeout_ms
        if server:
            given = make_url(url).query.get("options")
            if isinstance(given, tuple):
                given = " ".join(given)
            args["options"] = " ".join([given, *server] if given else server)
        return args


def make_engine(url: str, *, pool_size: int = 5, limits: ConnectionLimits | None = None) -> Engine:
    """A pooled engine for ``url`` (a SQLAlchemy URL); ``limits`` default to keepalives
    only (no server-side timeouts), the Runtime passes the settings' ones."""
    limits = limits if limits is not None else ConnectionLimits()
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size * 2,
        pool_pre_ping=True,
        pool_recycle=1800,
        connect_args=limits.connect_args(url),
    )


def make_fence_engine(url: str, *, limits: ConnectionLimits | None = None) -> Engine:
    """A small autocommit pool without pre-ping, for the fencing upsert of each lock
    acquisition: exactly one round trip (a pre-ping is one more, BEGIN/COMMIT two more). A
    dead pooled connection is retried once by the lock. Its ``lock_timeout`` bounds how
    long a new holder waits behind an old holder's fenced statement."""
    limits = limits if limits is not None else ConnectionLimits()
    return create_engine(
        url,
        pool_size=2,
        max_overflow=8,
        pool_pre_ping=False,
        pool_recycle=1800,
        isolation_level="AUTOCOMMIT",
        connect_args=limits.connect_args(url),
    )


@contextmanager
def transaction(engine: Engine) -> Iterator[Connection]:
    """One short database transaction: commit on success, roll back on error."""
    with engine.begin() as conn:
        yield conn
