"""Transient database errors inside a drain: retried on a fresh connection, for a bounded time.

A Postgres restart, a failover, a ``pg_terminate_backend``, a serialization failure or a
moment with every pooled connection busy must cost the holder a retry, not its task (which
Celery would ack, leaving the account to the sweeper). :class:`DbRetry` runs one database
call again with a short backoff with jitter while the error is transient
(:func:`payment_worker.db.retry.transient_reason`), for at most ``DB_RETRY_MAX_SECONDS``
from the call's first failure; between two tries the holder checks that its lock is still
its own and reports progress (it is waiting on purpose, for a bounded time). Past the bound
it raises :class:`~payment_worker.errors.DatabaseUnavailable`, and the drain gives the
account back (released, re-enqueued).

Every call retried here is safe to repeat, including one whose COMMIT succeeded but whose
answer was lost (docs/processing.md, "Database errors"): a claim leaves its items
``dispatching``, which the next claim turns ``unknown`` (looked up before any resend); a
record writes absolute values under the fence and only over rows still in doubt; completing
a batch and reading the next due time change nothing twice; a fencing token burnt by a lost
answer is only a gap.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from payment_worker.db.retry import short_error, transient_reason
from payment_worker.db.work import Claim
from payment_worker.domain.retry import Backoff
from payment_worker.domain.transitions import ItemOutcome
from payment_worker.errors import DatabaseUnavailable
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import DB_RETRIES
from payment_worker.worker.ports import HeldLock, WorkStore

log = get_logger("processing")

T = TypeVar("T")

# the first retry after about 50 ms, doubling up to 1 s: a restart is caught within a
# second of its end, and a fleet of holders does not reconnect in step (jitter)
DEFAULT_BACKOFF = Backoff(base=0.05, cap=1.0)


@dataclass(frozen=True)
class DbRetry:
    """How a drain retries transient database errors (``DB_RETRY_MAX_SECONDS``)."""

    max_seconds: float
    backoff: Backoff = DEFAULT_BACKOFF
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        account_id: str,
        between_tries: Callable[[], None] | None = None,
    ) -> T:
        """``fn()``, tried again while it fails with a transient database error.

        ``between_tries`` runs before each new try (a holder's ``ensure_held`` and
        ``progress``; it may raise to stop). Raises :class:`DatabaseUnavailable` once
        another try would start later than ``max_seconds`` after the first failure; any
        other error at once.
        """
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                reason = transient_reason(exc)
                if reason is None:
                    raise
                now = self.clock()
                first_failure = now if first_failure is None else first_failure
                attempt += 1
                ceiling = self.backoff.ceiling(attempt)
                # "equal jitter": never a zero wait, never two holders in step
                delay = ceiling / 2 + self.rng.uniform(0.0, ceiling / 2)
                if now + delay - first_failure > self.max_seconds:
                    log.warning(
                        "db_retry_exhausted",
                        account_id=account_id,
                        op=what,
                        reason=reason,
                        attempts=attempt,
                        seconds=round(now - first_failure, 3),
                        error=short_error(exc),
                    )
                    raise DatabaseUnavailable(
                        f"{what}: transient database errors for {now - first_failure:.1f}s "
                        f"({reason}: {short_error(exc)})"
                    ) from exc
                DB_RETRIES.labels(reason).inc()
                log.warning(
                    "db_retry",
                    account_id=account_id,
                    op=what,
                    reason=reason,
                    attempt=attempt,
                    delay=round(delay, 3),
                    error=short_error(exc),
                )
                self.sleep(delay)
                if between_tries is not None:
                    between_tries()


class RetryingStore:
    """A holder's :class:`~payment_worker.worker.ports.WorkStore` whose every call goes
    through :meth:`DbRetry.call`, with the lock checked and progress reported between tries."""

    def __init__(self, store: WorkStore, lock: HeldLock, retry: DbRetry, account_id: str) -> None:
        self._store = store
        self._lock = lock
        self._retry = retry
        self._account_id = account_id

    def _between_tries(self) -> None:
        self._lock.ensure_held()
        self._lock.progress()  # waiting on purpose, and only as long as the bound allows

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self._retry.call(
            what, fn, account_id=self._account_id, between_tries=self._between_tries
        )

    def claim_due(self, account_id: str, token: int, limit: int) -> Claim:
        """See :meth:`WorkStore.claim_due`."""
        return self._call("claim_due", lambda: self._store.claim_due(account_id, token, limit))

    def fence_and_claim(self, account_id: str, limit: int) -> Claim:
        """See :meth:`WorkStore.fence_and_claim` (a retry issues another token)."""
        return self._call("fence_and_claim", lambda: self._store.fence_and_claim(account_id, limit))

    def record_outcomes(self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]) -> int:
        """See :meth:`WorkStore.record_outcomes`."""
        return self._call(
            "record_outcomes", lambda: self._store.record_outcomes(account_id, token, outcomes)
        )

    def complete_batches(
        self, account_id: str, token: int, batch_pks: Sequence[int] | None = None
    ) -> list[str]:
        """See :meth:`WorkStore.complete_batches`."""
        return self._call(
            "complete_batches",
            lambda: self._store.complete_batches(account_id, token, batch_pks),
        )

    def record_and_finish(
        self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]
    ) -> tuple[int, list[str], float | None]:
        """See :meth:`WorkStore.record_and_finish`."""
        return self._call(
            "record_and_finish",
            lambda: self._store.record_and_finish(account_id, token, outcomes),
        )

    def record_and_claim(
        self,
        account_id: str,
        token: int,
        outcomes: Sequence[ItemOutcome],
        ended: Sequence[int],
        limit: int,
    ) -> tuple[int, list[str], Claim]:
        """See :meth:`WorkStore.record_and_claim` (a retry after a lost answer claims again:
        what the lost one took is found dispatching and looked up first)."""
        return self._call(
            "record_and_claim",
            lambda: self._store.record_and_claim(account_id, token, outcomes, ended, limit),
        )

    def complete_and_next_due(self, account_id: str, token: int) -> tuple[list[str], float | None]:
        """See :meth:`WorkStore.complete_and_next_due`."""
        return self._call(
            "complete_and_next_due",
            lambda: self._store.complete_and_next_due(account_id, token),
        )
