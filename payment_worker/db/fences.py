"""Fencing tokens: a per-account number in Postgres that grows on every lock acquisition.

Every state write of an account's rows is one statement that starts with :data:`FENCE_CTE`
and carries the writer's token; a writer whose token is no longer the account's current one
changes no row and gets :class:`FencedOut`. Redis never decides correctness on its own: a
holder that lost its Redis lock without noticing (a long pause, a partition) is stopped here.

Semantics of the fence under READ COMMITTED (PostgreSQL's default), see docs/locks.md:

* the CTE selects the account's fence row ``FOR SHARE``, and only while it holds the
  writer's token;
* if a newer token was issued but not yet committed, the CTE waits for that transaction and
  then re-checks the committed row (EvalPlanQual): it is empty, the old writer changes no row;
* once the CTE has passed, a concurrent :func:`next_fence_token` waits until the writer's
  transaction ends, so every write of that transaction is ordered before the newer token
  exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, TextClause, text
from sqlalchemy.exc import DBAPIError

from payment_worker.db.driver import fetch
from payment_worker.db.retry import transient_reason
from payment_worker.errors import FencedOut
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import DB_RETRIES

if TYPE_CHECKING:
    from payment_worker.db.driver import AnyConnection, Statement

FENCE_CTE = """fence AS (
    SELECT fence_token FROM account_fences
    WHERE account_id = :acct AND fence_token = :tok
    FOR SHARE
)"""
"""The fence, for a ``WITH`` clause: a CTE named ``fence`` that has one row when ``:tok`` is
the current token of account ``:acct``, and none otherwise.

A fenced statement makes each of its writes depend on ``fence`` (joins it, or filters by
``EXISTS (SELECT 1 FROM fence)``) and returns the verdict in a ``fenced_ok`` column, so a
stale token costs no second query. For :func:`execute_fenced`, e.g.::

    WITH <FENCE_CTE>,
    upd AS (UPDATE transactions t SET status = :status, fence_token = :tok, updated_at = now()
            FROM fence WHERE t.id = :id AND t.status = 'dispatching' RETURNING t.id)
    SELECT (SELECT count(*) FROM upd) AS updated, (SELECT count(*) FROM fence) AS fenced_ok
"""

NEXT_FENCE_CTE = """fence AS (
    INSERT INTO account_fences AS a (account_id, fence_token, updated_at)
    VALUES (:acct, 1, now())
    ON CONFLICT (account_id) DO UPDATE SET fence_token = a.fence_token + 1, updated_at = now()
    RETURNING a.fence_token
)"""
"""The fence that issues the next token, for a holder's first statement: a CTE named
``fence`` with one row, the account's new token (what :func:`next_fence_token` does, in the
same statement and transaction as the holder's first claim). It takes the fence row's lock
as that upsert does, so it waits for any fenced write still holding the row ``FOR SHARE``, and
a write of an older holder that comes after it finds no row in :data:`FENCE_CTE`. A statement
using it reads the token with ``(SELECT fence_token FROM fence)``, and must make its other
row locks wait for the CTE (``WHERE EXISTS (SELECT 1 FROM fence)``, a one-time filter): the
fence row first, as an older holder's fenced writes take it, so the two cannot deadlock."""

log = get_logger("locks")

_NEXT_SQL = text(
    "INSERT INTO account_fences AS a (account_id, fence_token, updated_at)"
    " VALUES (:account_id, 1, now())"
    " ON CONFLICT (account_id) DO UPDATE"
    " SET fence_token = a.fence_token + 1, updated_at = now()"
    " RETURNING a.fence_token"
)


def fence_params(account_id: str, token: int) -> dict[str, Any]:
    """The bound parameters :data:`FENCE_CTE` needs (``:acct``, ``:tok``)."""
    return {"acct": account_id, "tok": token}


def execute_fenced(
    conn: AnyConnection,
    statement: Statement | TextClause,
    params: Mapping[str, Any],
    *,
    account_id: str,
    token: int,
) -> Sequence[Mapping[str, Any]]:
    """Run a fenced statement and return its rows; raise :class:`FencedOut` if the token is stale.

    ``statement`` starts with ``WITH`` :data:`FENCE_CTE` and returns at least one row, whose
    ``fenced_ok`` column is the verdict. A current token with a state condition that simply
    did not match is no rejection: the statement's own columns tell what changed. The caller
    that handles :class:`FencedOut` counts it (``payment_worker_fencing_rejections_total``).
    """
    rows = fetch(conn, statement, {**params, **fence_params(account_id, token)})
    if not rows[0]["fenced_ok"]:
        raise FencedOut(f"fencing token {token} of account {account_id} is no longer current")
    return rows


def next_fence_token(conn: Connection, account_id: str) -> int:
    """Issue the account's next fencing token (1 for a new account): one atomic statement.

    The upsert takes the fence row's lock, so it waits for any transaction whose fenced
    writes still hold that row ``FOR SHARE``.
    """
    token = conn.execute(_NEXT_SQL, {"account_id": account_id}).scalar_one()
    return int(token)


def issue_fence_token(engine: Engine, account_id: str) -> int:
    """The account's next fencing token; a stale pooled connection is retried once.

    ``engine`` is best an autocommit view of a pool without pre-ping (``db.engine.autocommit``):
    the upsert is then one round trip. A retry may burn a number (the first upsert may have
    committed before the connection died); tokens only need to grow, so a gap is harmless.
    """
    for attempt in (1, 2):
        try:
            # begin(): a commit on any engine, and no BEGIN/COMMIT round trip on an
            # autocommit one
            with engine.begin() as conn:
                return next_fence_token(conn, account_id)
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
            # counted as the drain's retries are: the pool replaces its other dead connections
            # after this one, so a restart met here first would otherwise leave no trace
            reason = transient_reason(exc) or "disconnect"
            DB_RETRIES.labels(reason).inc()
            log.warning("db_retry", account_id=account_id, op="fence", reason=reason, attempt=1)
    raise AssertionError("unreachable")  # pragma: no cover
