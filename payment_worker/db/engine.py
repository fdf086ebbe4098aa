"""The process's one SQLAlchemy engine: a bounded pool shared by every caller.

Built by :class:`~payment_worker.runtime.Runtime`, once per process; never cached here.

One pool of ``DB_POOL_SIZE`` connections and no overflow, so a worker process never holds
more Postgres connections than that, whatever its concurrency. Nobody keeps a connection
across a gateway call: the drain's store checks one out per statement
(:class:`~payment_worker.db.work_store.PgWorkStore`), and so does the fencing upsert of each lock
acquisition, through the engine's autocommit view (:func:`autocommit`: the same pool).

Every connection starts with the service's :class:`ConnectionLimits`: a
``statement_timeout`` and a ``lock_timeout`` sent at connect time (libpq ``options``, so no
``SET`` round trip), and TCP keepalives plus a TCP user timeout, so that a statement blocked
on a lock, a server that stopped answering or a silently dropped network never holds a
worker (and its account lock) for ever. Behind PgBouncer (``DB_PGBOUNCER``) the timeouts
come from the database role instead, and no statement is ever prepared.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.pool import QueuePool

from payment_worker.db.retry import plan_changed

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

    def connect_args(
        self, url: str, *, application_name: str | None = None, pgbouncer: bool = False
    ) -> dict[str, Any]:
        """libpq (and psycopg) connection parameters for an engine on ``url`` (SQLAlchemy form).

        Server settings go in libpq's ``options`` (``-c name=value``), appended to any
        ``options`` the URL already carries; keepalives and the TCP user timeout are
        ignored by libpq on a unix socket (the embedded server's), which needs none.
        ``application_name`` names the process in ``pg_stat_activity`` (unless the URL names
        one). ``pgbouncer``: the server is reached through PgBouncer in transaction pooling
        mode, so nothing goes in ``options`` (PgBouncer refuses the startup parameter; the
        timeouts then come from the role, see docs/configuration.md) and psycopg never
        prepares a statement (a prepared statement lives in one server session, which the
        next transaction may not get).
        """
        server = [
            f"-c {name}={value}"
            for name, value in (
                ("statement_timeout", self.statement_timeout_ms),
                ("lock_timeout", self.lock_timeout_ms),
            )
            if value > 0 and not pgbouncer
        ]
        query = make_url(url).query
        given = query.get("options")
        if isinstance(given, tuple):
            given = " ".join(given)
        if not pgbouncer and "jit" not in (given or ""):
            # every statement here is short: JIT compilation only costs (a sweeper query on a
            # server with LLVM, estimated above jit_above_cost, spent 1.7 s compiling)
            server.append("-c jit=off")
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
            args["options"] = " ".join([given, *server] if given else server)
        if application_name and "application_name" not in query:
            args["application_name"] = application_name
        if pgbouncer:
            args["prepare_threshold"] = None
        return args


@dataclass(frozen=True, slots=True)
class LooseTimeout:
    """A server timeout looser than the service asks for: ``name`` (``statement_timeout``,
    ``lock_timeout``), what the server's connections start with (``server_ms``, 0 = none)
    and what the setting wants (``wanted_ms``)."""

    name: str
    server_ms: int
    wanted_ms: int


_SERVER_TIMEOUTS_SQL = (
    "SELECT name, setting::bigint FROM pg_settings"
    " WHERE name IN ('statement_timeout', 'lock_timeout')"
)


def loose_server_timeouts(conn: Connection, limits: ConnectionLimits) -> list[LooseTimeout]:
    """The timeouts that the server's sessions (``conn``'s) do not bound as tightly as
    ``limits`` wants: none (0) or a larger value. Behind a transaction-mode PgBouncer the
    service cannot send them, so they must come from the role or the database (see
    docs/configuration.md); this tells when they do not. One read of ``pg_settings``."""
    wanted = {
        "statement_timeout": limits.statement_timeout_ms,
        "lock_timeout": limits.lock_timeout_ms,
    }
    loose = []
    for name, value in conn.exec_driver_sql(_SERVER_TIMEOUTS_SQL).all():
        server_ms, want = int(value), wanted[str(name)]
        if want > 0 and (server_ms == 0 or server_ms > want):
            loose.append(LooseTimeout(str(name), server_ms, want))
    return sorted(loose, key=lambda t: t.name)


def application_name(pid: int, host: str | None = None) -> str:
    """``payment-worker:<pid>@<host>``: one process's name in ``pg_stat_activity`` (the
    server keeps 63 bytes; the pid comes first so that a long host name cannot cut it)."""
    host = host if host is not None else socket.gethostname()
    return f"payment-worker:{pid}@{host}"[:63]


def make_engine(
    url: str,
    *,
    pool_size: int = 5,
    pool_timeout: float = 5.0,
    limits: ConnectionLimits | None = None,
    application_name: str | None = None,
    pgbouncer: bool = False,
) -> Engine:
    """The process's one pooled engine for ``url`` (a SQLAlchemy URL).

    At most ``pool_size`` connections, ever (no overflow): a caller that finds them all
    checked out waits up to ``pool_timeout`` seconds, then gets SQLAlchemy's
    ``TimeoutError`` (a transient error, see :mod:`payment_worker.db.retry`). No pre-ping
    on every checkout (it would double the round trips of the drain's one-statement
    calls): a connection idle for :data:`PING_AFTER_IDLE_S` is pinged when checked out, and
    one that dies under a statement invalidates its whole generation (SQLAlchemy), so the
    retry gets a fresh one. ``limits`` default to keepalives only (no server-side
    timeouts); the Runtime passes the settings' ones. ``pgbouncer``: see
    :meth:`ConnectionLimits.connect_args`.
    """
    limits = limits if limits is not None else ConnectionLimits()
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=0,
        pool_timeout=pool_timeout,
        pool_pre_ping=False,
        pool_use_lifo=True,  # the hot few stay hot; the rest idle (and get pinged)
        pool_recycle=1800,
        connect_args=limits.connect_args(
            url, application_name=application_name, pgbouncer=pgbouncer
        ),
    )
    _ping_after_idle(engine)
    _drop_stale_prepared(engine)
    return engine


def open_pool(engine: Engine) -> int:
    """Open every connection of ``engine``'s pool now (its ``pool_size``), all checked out
    at once and given back idle; returns how many the pool holds.

    Why: a Postgres connection costs a backend process started and authenticated, about as
    much as hundreds of statements; a fresh worker met by a burst of accounts opened its
    pool among its busy task threads, where every statement waited for one."""
    pool = engine.pool
    fairies: list[Any] = []
    try:
        for _ in range(pool.size() if isinstance(pool, QueuePool) else 0):
            fairies.append(engine.raw_connection())
    finally:
        for fairy in fairies:
            fairy.close()
    return len(fairies)


def autocommit(engine: Engine) -> Engine:
    """A view of ``engine`` (same pool, same budget) whose connections run in autocommit:
    each statement is its own transaction, with no BEGIN/COMMIT round trips (psycopg
    switches autocommit on the client side). The drain's store and the fencing upsert use it.
    """
    if engine.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        # already the view (the drain's store gets the Runtime's): a second layer of options
        # would be built per drain and merged again on every connect, for nothing
        return engine
    return engine.execution_options(isolation_level="AUTOCOMMIT")


# a pooled connection unused for this long is pinged at checkout (one round trip), so a
# server restart during a quiet spell costs nobody an error; busy connections are not
PING_AFTER_IDLE_S = 5.0
_CHECKED_IN = "pw_checked_in"


def _ping_after_idle(engine: Engine) -> None:
    def on_checkin(dbapi_conn: Any, record: Any) -> None:
        record.info[_CHECKED_IN] = time.monotonic()

    def on_checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.get(_CHECKED_IN)
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            # the pool then replaces this connection (and retries the checkout)
            raise DisconnectionError(f"stale pooled connection: {exc}") from exc

    event.listen(engine.pool, "checkin", on_checkin)
    event.listen(engine.pool, "checkout", on_checkout)


def _drop_stale_prepared(engine: Engine) -> None:
    """A statement of SQLAlchemy's that Postgres refuses because the connection prepared it
    before a column it returns changed type (psycopg prepares a statement run five times on
    a connection): that connection alone is dropped, as after a disconnect, so the next
    statement gets one without stale prepared statements (the drain's own statements do the
    same in :func:`~payment_worker.db.driver.checked_out`)."""

    def on_error(context: ExceptionContext) -> None:
        if plan_changed(context.original_exception):
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = False

    event.listen(engine, "handle_error", on_error)


@contextmanager
def transaction(engine: Engine) -> Iterator[Connection]:
    """One short database transaction: commit on success, roll back on error."""
    with engine.begin() as conn:
        yield conn
