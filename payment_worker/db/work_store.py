"""The drain's database, :class:`PgWorkStore`: the statements of :mod:`payment_worker.db.work`,
each on a connection checked out of the pool for that statement alone."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from sqlalchemy import Engine

# the statements are called through their module, so a test that replaces one (a takeover
# between two statements, say) reaches the store too
from payment_worker.db import work
from payment_worker.db.driver import checked_out
from payment_worker.db.work import Claim

if TYPE_CHECKING:
    from payment_worker.domain.transitions import ItemOutcome


class PgWorkStore:
    """The drain loop's :class:`~payment_worker.worker.ports.WorkStore`: each call checks a
    connection out of the pool, runs its one statement in autocommit (its own short
    transaction) and gives the connection back, so no connection is held across a gateway
    call and a holder waiting on the gateway costs the pool nothing. A call that fails on a
    dead connection leaves the next one a fresh connection (the pool drops the dead one).
    The statements run on the pooled psycopg connection (:mod:`payment_worker.db.driver`:
    a third to a half less client CPU a statement than through SQLAlchemy's execution
    layer)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @classmethod
    @contextmanager
    def open(cls, engine: Engine) -> Iterator[PgWorkStore]:
        """A store on ``engine``'s pool for one drain (nothing to give back at the end)."""
        yield cls(engine)

    def claim_due(self, account_id: str, token: int, limit: int) -> Claim:
        """See :func:`~payment_worker.db.work.claim_due`."""
        with checked_out(self._engine) as conn:
            return work.claim_due(conn, account_id, token, limit)

    def fence_and_claim(self, account_id: str, limit: int) -> Claim:
        """See :func:`~payment_worker.db.work.fence_and_claim`."""
        with checked_out(self._engine) as conn:
            return work.fence_and_claim(conn, account_id, limit)

    def record_outcomes(self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]) -> int:
        """See :func:`~payment_worker.db.work.record_outcomes`."""
        with checked_out(self._engine) as conn:
            return work.record_outcomes(conn, account_id, token, outcomes)

    def record_and_finish(
        self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]
    ) -> tuple[int, list[str], float | None]:
        """See :func:`~payment_worker.db.work.record_and_finish`."""
        with checked_out(self._engine) as conn:
            return work.record_and_finish(conn, account_id, token, outcomes)

    def record_and_claim(
        self,
        account_id: str,
        token: int,
        outcomes: Sequence[ItemOutcome],
        ended: Sequence[int],
        limit: int,
    ) -> tuple[int, list[str], Claim]:
        """See :func:`~payment_worker.db.work.record_and_claim`."""
        with checked_out(self._engine) as conn:
            return work.record_and_claim(conn, account_id, token, outcomes, ended, limit)

    def complete_batches(
        self, account_id: str, token: int, batch_pks: Sequence[int] | None = None
    ) -> list[str]:
        """See :func:`~payment_worker.db.work.complete_batches`."""
        with checked_out(self._engine) as conn:
            return work.complete_batches(conn, account_id, token, batch_pks)

    def complete_and_next_due(self, account_id: str, token: int) -> tuple[list[str], float | None]:
        """See :func:`~payment_worker.db.work.complete_and_next_due`."""
        with checked_out(self._engine) as conn:
            return work.complete_and_next_due(conn, account_id, token)
