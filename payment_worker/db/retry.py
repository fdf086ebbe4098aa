"""Which database errors are transient: worth another try on a fresh connection.

The drain retries these for a bounded time (``DB_RETRY_MAX_SECONDS``) instead of failing its
task (:mod:`payment_worker.worker.store_retry`). Every statement it retries is safe to run
again (docs/processing.md, "Database errors"); the classification lives here, with the SQL.

Transient: the connection broke (reset, server restart, ``pg_terminate_backend``: admin
shutdown 57P01, crash shutdown 57P02), the server cannot take connections yet (57P03,
starting up or shutting down: a failover or a restart), connecting failed, the server is a
standby now (read-only transaction 25006, a failover caught half way), a serialization
failure (40001) or a deadlock (40P01), no free pooled connection within
``DB_POOL_TIMEOUT``, and a prepared statement whose result columns changed type under it (a
migration that altered one while workers ran: Postgres then refuses that statement on every
connection that prepared it, so the connection is dropped and the retry prepares it afresh;
:func:`plan_changed`). Not transient: a statement or lock timeout (57014, 55P03; the bounds
that stop a blocked holder on purpose), constraint violations, bad SQL, anything else.
"""

from __future__ import annotations

import psycopg
from psycopg import errors as pg_errors
from sqlalchemy import exc as sa_exc

# SQLSTATE -> the metric's reason label (payment_worker_db_retries_total{reason})
_BY_SQLSTATE = {
    "57P01": "admin_shutdown",
    "57P02": "crash_shutdown",
    "57P03": "cannot_connect_now",
    "40001": "serialization_failure",
    "40P01": "deadlock",
    "25006": "read_only",
    "08000": "connection",
    "08003": "connection",
    "08006": "connection",
    "08001": "connection",
    "08004": "connection",
}
# never retried, whatever else is true of them: the bounds that stop a blocked holder
_NEVER = (pg_errors.QueryCanceled, pg_errors.LockNotAvailable)

REASONS = (
    "admin_shutdown",
    "crash_shutdown",
    "cannot_connect_now",
    "serialization_failure",
    "deadlock",
    "read_only",
    "connection",
    "disconnect",
    "pool_timeout",
    "plan_changed",
)
"""Every reason :func:`transient_reason` may return (the metric's bounded label values)."""


# Postgres's words (0A000, feature not supported) for a prepared statement it will not run
# again on this connection: a column it returns changed type since it was prepared
_PLAN_CHANGED = "cached plan must not change result type"


def plan_changed(exc: BaseException) -> bool:
    """True when ``exc`` (a driver error, or SQLAlchemy's around one) says a statement
    prepared on the connection returns columns of another type now: the connection's
    prepared statements are stale, and it must not run them again."""
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    return isinstance(orig, pg_errors.FeatureNotSupported) and _PLAN_CHANGED in str(orig)


def transient_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is a transient database error (a label of :data:`REASONS`), or None."""
    if isinstance(exc, sa_exc.TimeoutError):
        return "pool_timeout"  # QueuePool: no free connection within DB_POOL_TIMEOUT
    if plan_changed(exc):
        return "plan_changed"  # refused before it ran; its connection was dropped
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    if isinstance(orig, _NEVER):
        return None
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in _BY_SQLSTATE:
        return _BY_SQLSTATE[sqlstate]
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return "disconnect"  # the connection died under the statement (reset, restart)
    if isinstance(orig, psycopg.OperationalError) and sqlstate is None:
        # no answer from a server at all: connection refused, reset, closed, timed out
        return "connection"
    return None


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is worth another try on a fresh connection (see the module)."""
    return transient_reason(exc) is not None


def short_error(exc: BaseException) -> str:
    """The first line of a database error, for a log line (SQLAlchemy appends the statement
    and its parameters)."""
    text = str(getattr(exc, "orig", None) or exc)
    return text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
