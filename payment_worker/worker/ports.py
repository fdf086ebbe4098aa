"""What the drain loop needs from the outside world, as small interfaces.

The loop talks to the database, the account lock, the gateway and the queue only through
these, so it runs the same against the real adapters (``db.work_store.PgWorkStore``,
``locks.AccountLock``, ``gateway.GatewayClient``, ``worker.queueing.RedisAccountQueue``) and
against the in-memory fakes of the unit tests (``tests/fakes.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from payment_worker.db.work import Claim
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.transitions import ItemOutcome
from payment_worker.gateway.outcomes import GatewayResult
from payment_worker.locks.arrival import Arrival, EndRider, Rider

Guard = Callable[[], None]
"""Raises when the caller may no longer send (the lock's ``ensure_held``)."""


class WorkStore(Protocol):
    """One drain's database: every call is one short statement, writes are fenced (a stale
    ``token`` raises :class:`~payment_worker.errors.FencedOut`)."""

    def claim_due(self, account_id: str, token: int, limit: int) -> Claim:
        """Claim up to ``limit`` due items: intent recorded before any send; ``more_due``
        says whether more than ``limit`` were due."""
        ...

    def fence_and_claim(self, account_id: str, limit: int) -> Claim:
        """A holder's first claim: issue the account's next fencing token and claim with it,
        in one statement; the token is the answer's ``fence_token``."""
        ...

    def record_outcomes(self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]) -> int:
        """Write what was learnt; terminal rows never move back. Returns rows changed."""
        ...

    def complete_batches(
        self, account_id: str, token: int, batch_pks: Sequence[int] | None = None
    ) -> list[str]:
        """Complete the account's batches whose items are all terminal."""
        ...

    def record_and_finish(
        self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]
    ) -> tuple[int, list[str], float | None]:
        """A drain's last chunk in one statement: ``record_outcomes`` (rows changed), then
        ``complete_and_next_due`` (batches completed, next due). Fenced."""
        ...

    def record_and_claim(
        self,
        account_id: str,
        token: int,
        outcomes: Sequence[ItemOutcome],
        ended: Sequence[int],
        limit: int,
    ) -> tuple[int, list[str], Claim]:
        """A chunk boundary in one statement: ``record_outcomes`` (rows changed), then
        ``complete_batches(ended)`` (those completed), then ``claim_due(limit)`` for the next
        chunk, which never takes a row just recorded. Fenced."""
        ...

    def complete_and_next_due(self, account_id: str, token: int) -> tuple[list[str], float | None]:
        """As a drain ends, in one statement: complete all the account's batches whose items
        are all terminal (their ids), and the seconds until its earliest open item is due
        (<= 0: now; None: nothing open). Fenced: a stale ``token`` raises FencedOut."""
        ...


class HeldLock(Protocol):
    """An account lock: taken once, checked before every side effect, released once."""

    @property
    def fence_token(self) -> int | None:
        """The fencing token of the current acquisition."""
        ...

    def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        arrival: Arrival | None = None,
        fence: bool = True,
        rider: Rider | None = None,
    ) -> bool:
        """Take the lock (non-blocking by default); ``arrival``'s mark is left when it is not
        taken, and cleared when it is, in the same step. ``fence=False``: no fencing token is
        taken; the first claim issues it (:meth:`WorkStore.fence_and_claim`). ``rider``:
        what the gateway reads in that same step when the lock is taken
        (:meth:`Gateway.account_start`)."""
        ...

    def adopt_fence(self, token: int) -> None:
        """The token the holder's first claim issued becomes :attr:`fence_token`."""
        ...

    def ensure_held(self) -> None:
        """Raise :class:`~payment_worker.errors.LockLost` unless the lock is still ours."""
        ...

    def progress(self) -> None:
        """The holder got something done; a holder that reports nothing for
        ``LOCK_MAX_STALL_SECONDS`` loses its lock (the watchdog stops renewing it)."""
        ...

    def release(self, arrival: Arrival | None = None, rider: EndRider | None = None) -> bool:
        """Give the lock back (owner-checked); with ``arrival``, read its mark in the same
        step into :attr:`marked`; with ``rider`` too, give back what it names in that step
        (:meth:`Gateway.account_end`)."""
        ...

    @property
    def marked(self) -> bool | None:
        """After ``release(arrival)``: whether the mark was there (work arrived while the
        lock was held); None when it could not be read."""
        ...


class Gateway(Protocol):
    """The payment gateway: every call under the transaction's stable idempotency key."""

    def create_payment(
        self,
        account_id: str,
        transaction: PaymentRequest,
        idempotency_key: str,
        guard: Guard | None = None,
        *,
        held: bool = False,
    ) -> GatewayResult:
        """Send a payment; ``guard`` runs right before the request leaves; ``held``: the
        caller holds the account's lock (nobody else sends for the account meanwhile)."""
        ...

    def lookup_payment(
        self,
        account_id: str,
        idempotency_key: str,
        guard: Guard | None = None,
        *,
        held: bool = False,
    ) -> GatewayResult:
        """Ask the gateway what it holds under the key; ``guard``, ``held`` as above."""
        ...

    def account_start(self, account_id: str) -> Rider | None:
        """What the caller's first requests for the account would read from shared state
        (its token, a block of pacing slots), to read in the lock's own round trip instead;
        None when nothing needs reading. Whatever the rider leaves unread (a lock not taken
        by it), the requests read as before."""
        ...

    def prefetch_token(self, account_id: str) -> None:
        """The caller holds the account's lock and is about to claim its first items: a
        token request its start found needed is sent now, its answer read by the first
        request (the gateway's latency spent while the claim runs). Never raises."""
        ...

    def account_end(self, account_id: str) -> EndRider | None:
        """The caller is about to release the account: what it reserved for its next
        requests and did not use (pacing slots, a token refresh it took and did not make),
        to give back in the lock's release, so the next holder need not wait for them; None
        when there is nothing. Never raises for a shared-state error (at worst the next
        holder waits)."""
        ...


class AccountQueue(Protocol):
    """How work reaches an account's holder: the "work waiting" mark and the broker."""

    def arrival(self, account_id: str, batch_id: str) -> Arrival:
        """The work a task brings to the account's lock attempt: the mark a busy holder checks
        after releasing, and the marks a taker clears (everything committed so far is then
        drained by the taker)."""
        ...

    def announced(self, account_id: str) -> bool:
        """Whether the mark was left again since the lock was taken."""
        ...

    def hand_off(self, account_id: str, batch_id: str) -> None:
        """End of a slice: put the account back on the queue."""
        ...

    def schedule(self, account_id: str, batch_id: str, wait: float) -> float:
        """One delayed message for work due in ``wait`` seconds; returns the countdown."""
        ...
