"""The drain's statements on the pool's psycopg connection, past SQLAlchemy's execution layer.

A drain runs two or three short statements per account, each on a connection checked out of
the engine's pool for that statement alone. Through SQLAlchemy each one paid about as much
client CPU again as psycopg's own execution: a ``Connection`` built and closed, the isolation
level switched and reset, the execution context, the result's metadata built from the
cursor's description (measured: about 260 against 125 µs a statement; docs/benchmarks.md,
"Twenty-third session"). The statements here keep SQLAlchemy's pool, its budget
(``DB_POOL_SIZE``) and its checkout and checkin events (the ping after an idle spell), and
run on the driver connection it pools:

* :func:`checked_out`: one pooled connection in autocommit for one statement, given back
  in the state it was taken in; a connection that broke invalidates its generation and the
  error is SQLAlchemy's, so :mod:`payment_worker.db.retry` classifies it as before;
* :class:`Statement`: a statement's text compiled once for psycopg (``%(name)s``), with its
  SQLAlchemy form for a caller's own ``Connection`` (tools, tests: its transaction);
* :func:`fetch`: a statement's rows as mappings, on either kind of connection.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Connection, Engine, TextClause
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

from payment_worker.db.retry import plan_changed
from payment_worker.db.sql_text import compact_text

DriverConnection: TypeAlias = "psycopg.Connection[Any]"
"""A pooled connection's psycopg connection, as :func:`checked_out` yields it."""

AnyConnection: TypeAlias = "Connection | psycopg.Connection[Any]"
"""What the repository's drain functions run on: a SQLAlchemy connection (in its
transaction) or a driver connection of :func:`checked_out` (autocommit)."""

_PSYCOPG: Dialect = psycopg_dialect()  # type: ignore[no-untyped-call]


@dataclass(frozen=True, slots=True)
class Statement:
    """One SQL statement in both forms: ``clause`` (SQLAlchemy ``text()``, ``:name`` binds)
    and ``sql``, the same text as psycopg takes it (``%(name)s``), compiled once."""

    clause: TextClause
    sql: str

    @classmethod
    def of(cls, source: str) -> Statement:
        """The statement of ``source`` (``:name`` binds), compacted
        (:func:`~payment_worker.db.sql_text.compact`) and compiled for psycopg."""
        clause = compact_text(source)
        return cls(clause, str(clause.compile(dialect=_PSYCOPG)))

    @property
    def text(self) -> str:
        """The statement's text with ``:name`` binds (as ``TextClause.text``)."""
        return self.clause.text


def fetch(
    conn: AnyConnection, statement: Statement | TextClause, params: Mapping[str, Any]
) -> Sequence[Mapping[str, Any]]:
    """Run ``statement`` and return all its rows as mappings (column name to value).

    On a SQLAlchemy ``Connection`` it runs through SQLAlchemy, in that connection's
    transaction; on a driver connection (:func:`checked_out`) straight on psycopg, which
    needs a :class:`Statement`. The values are the driver's either way (``text()`` declares no
    types, so SQLAlchemy converts none).
    """
    if isinstance(conn, Connection):
        clause = statement.clause if isinstance(statement, Statement) else statement
        return cast("Sequence[Mapping[str, Any]]", conn.execute(clause, params).mappings().all())
    if not isinstance(statement, Statement):
        raise TypeError("a driver connection runs a Statement (its psycopg text)")
    with conn.cursor(row_factory=dict_row) as cur:
        # prepared at its first run on this connection, not after psycopg's default five:
        # Postgres then plans it for its parameters five times and, where the generic plan is
        # no costlier, never again on this connection. A fresh worker's burst no longer plans
        # every statement up to ten times per pooled connection (docs/benchmarks.md,
        # "Twenty-ninth session"). Behind PgBouncer the connection prepares nothing
        # (``prepare_threshold`` None overrides this)
        cur.execute(statement.sql, params, prepare=True)
        return cur.fetchall()


@contextmanager
def checked_out(engine: Engine) -> Iterator[DriverConnection]:
    """A connection of ``engine``'s pool, for one statement in autocommit.

    The pool's budget and events apply as to any checkout. The connection goes back with
    autocommit off again (what every other user of the pool expects; psycopg switches it
    on the client side, no round trip). A psycopg error comes out as SQLAlchemy's
    (``DBAPIError.instance``, as a statement of SQLAlchemy's own would raise it); when the
    connection broke under it, the pool drops it and every connection opened before it
    (SQLAlchemy's rule for a disconnect); when its prepared statements went stale (a
    migration), the pool drops that connection alone. Either way the error says
    ``connection_invalidated``.
    """
    fairy = engine.raw_connection()
    try:
        conn = cast("DriverConnection", fairy.driver_connection)
        try:
            conn.autocommit = True
            yield conn
        except psycopg.Error as exc:
            # what SQLAlchemy's psycopg dialect calls a disconnect
            broken = conn.closed or conn.broken
            stale = not broken and plan_changed(exc)
            if broken:
                # the generation: a server restart broke its siblings too. The pool's own
                # method, the one SQLAlchemy calls for a disconnect under its statements
                engine.pool._invalidate(fairy, exc)
            elif stale:
                # this connection's prepared statements are stale (a migration changed a
                # column they return): it goes alone, and the retry prepares on a fresh one
                fairy.invalidate(exc)
            # as SQLAlchemy says it for its own statements (db.engine's handle_error)
            raise DBAPIError.instance(
                None, None, exc, psycopg.Error, connection_invalidated=broken or stale
            ) from exc
        finally:
            _reset(fairy, conn)
    finally:
        fairy.close()


def _reset(fairy: Any, conn: DriverConnection) -> None:
    """Autocommit off again before the connection goes back; a connection that cannot be
    reset (broken, or left inside a statement) is dropped by the pool instead."""
    if not fairy.is_valid:
        return
    try:
        conn.autocommit = False
    except psycopg.Error as exc:
        fairy.invalidate(exc)
