"""Fencing tokens: a per-account number in Postgres that grows on every lock acquisition.

Every state write of an account's transactions carries the writer's token and is guarded
by :data:`FENCE_GUARD_SQL`; a writer whose token is no longer the account's current one
changes no row. Redis never decides correctness on its own: a holder that lost its Redis
lock without noticing (a long pause, a partition) is stopped here.

Semantics of the guard under READ COMMITTED (PostgreSQL's default), see docs/locks.md:

* the guard's sub-SELECT locks the account's fence row ``FOR SHARE``;
* if a newer token was issued but not yet committed, the guard waits for that transaction
  and then re-checks the committed row (EvalPlanQual): the old writer changes no row;
* once the guard has passed, a concurrent :func:`next_fence_token` waits until the
  writer's transaction ends, so every write of that transaction is ordered before the
  newer token exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, CursorResult, Executable, TextClause, bindparam, text

from payment_worker.errors import FencedOut
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import FENCING_REJECTIONS

log = get_logger("fences")

# Bound parameter names are prefixed so the guard can sit in a statement that binds its
# own ``:account_id`` without a clash.
FENCE_GUARD_SQL = (
    "EXISTS (SELECT 1 FROM account_fences f"
    " WHERE f.account_id = :fence_account_id AND f.fence_token = :fence_token"
    " FOR SHARE OF f)"
)
"""A boolean SQL fragment for the WHERE clause of a fenced UPDATE.

Binds ``:fence_account_id`` and ``:fence_token``. True only when ``:fence_token`` is the
account's current token; it costs no extra round trip. Example::

    UPDATE transactions SET status = 'succeeded', fence_token = :fence_token
     WHERE id = :id AND status = 'dispatching' AND <FENCE_GUARD_SQL>
"""

_NEXT_SQL = text(
    "INSERT INTO account_fences AS a (account_id, fence_token, updated_at)"
    " VALUES (:account_id, 1, now())"
    " ON CONFLICT (account_id) DO UPDATE"
    " SET fence_token = a.fence_token + 1, updated_at = now()"
    " RETURNING a.fence_token"
)
_CURRENT_SQL = text("SELECT fence_token FROM account_fences WHERE account_id = :account_id")
_CHECK_SQL = text("SELECT fence_token FROM account_fences WHERE account_id = :account_id FOR SHARE")


def fence_params(account_id: str, fence_token: int) -> dict[str, Any]:
    """The bound parameters :data:`FENCE_GUARD_SQL` needs."""
    return {"fence_account_id": account_id, "fence_token": fence_token}


# the Core variant binds its own names: ``.values(fence_token=...)`` already owns
# a ``fence_token`` bind parameter in the same statement
_GUARD_CORE_SQL = FENCE_GUARD_SQL.replace(":fence_account_id", ":fence_guard_account_id").replace(
    ":fence_token", ":fence_guard_token"
)


def fence_guard(account_id: str, fence_token: int) -> TextClause:
    """:data:`FENCE_GUARD_SQL` with its values bound, for a SQLAlchemy Core ``where()``."""
    return text(_GUARD_CORE_SQL).bindparams(
        bindparam("fence_guard_account_id", account_id),
        bindparam("fence_guard_token", fence_token),
    )


def next_fence_token(conn: Connection, account_id: str) -> int:
    """Issue the account's next fencing token (1 for a new account): one atomic statement.

    The upsert takes the fence row's lock, so it waits for any transaction whose fenced
    writes still hold that row ``FOR SHARE``.
    """
    token = conn.execute(_NEXT_SQL, {"account_id": account_id}).scalar_one()
    return int(token)


def current_fence_token(conn: Connection, account_id: str) -> int:
    """The account's current token; 0 when no lock was ever acquired for it."""
    token = conn.execute(_CURRENT_SQL, {"account_id": account_id}).scalar_one_or_none()
    return 0 if token is None else int(token)


def _rejected(account_id: str, fence_token: int, current: int) -> FencedOut:
    FENCING_REJECTIONS.inc()
    log.warning("fenced_out", account_id=account_id, fence_token=fence_token, current_token=current)
    return FencedOut(
        f"account {account_id}: fencing token {fence_token} is stale (current {current})"
    )


def check_fence(conn: Connection, account_id: str, token: int) -> None:
    """Raise :class:`FencedOut` unless ``token`` is the account's current token.

    Runs ``SELECT ... FOR SHARE`` in the caller's transaction: until that transaction
    ends, no newer token can be issued, so the caller's following writes in the same
    transaction are fenced too. A token newer than the stored one (impossible unless the
    database was reset) is rejected as well.
    """
    row = conn.execute(_CHECK_SQL, {"account_id": account_id}).scalar_one_or_none()
    current = 0 if row is None else int(row)
    if current != token:
        raise _rejected(account_id, token, current)


def execute_fenced(
    conn: Connection,
    statement: Executable,
    params: Mapping[str, Any] | None,
    *,
    account_id: str,
    fence_token: int,
) -> CursorResult[Any]:
    """Run a fenced UPDATE; raise :class:`FencedOut` if the token is stale.

    ``statement`` is text SQL embedding :data:`FENCE_GUARD_SQL` (its parameters are added
    to ``params`` here) or a Core UPDATE filtered by :func:`fence_guard`. When it changes
    no row, one more query tells a stale token (:class:`FencedOut`) from a state
    condition that simply did not match (the result is returned, ``rowcount == 0``).
    """
    merged = dict(params or {})
    if isinstance(statement, TextClause):
        # text SQL embeds FENCE_GUARD_SQL; a Core statement carries fence_guard()'s values
        merged.update(fence_params(account_id, fence_token))
    result: CursorResult[Any] = conn.execute(statement, merged)
    if result.rowcount == 0:
        check_fence(conn, account_id, fence_token)
    return result
