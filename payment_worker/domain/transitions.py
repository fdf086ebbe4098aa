"""The transaction state machine of design.md, as pure functions (no I/O).

Given an item's counters and what the gateway answered, decide its next state. The
processing loop applies the decision; the repository writes it, fenced.

    pending/retryable --send--> succeeded | failed | retryable | unknown | dead
    unknown --lookup--> succeeded | failed | (not found: send again, same key) | unknown | dead
"""

from __future__ import annotations

from dataclasses import dataclass

from payment_worker.domain.retry import Backoff
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES, DeadReason, KeyStatus, TxStatus
from payment_worker.gateway.outcomes import GatewayResult, Outcome


@dataclass(frozen=True, slots=True)
class Policy:
    """Retry limits and timing (from settings)."""

    max_attempts: int
    max_lookups: int
    backoff: Backoff


@dataclass(frozen=True, slots=True)
class Decision:
    """The next state of one transaction, and what to write with it."""

    status: TxStatus
    delay: float = 0.0  # seconds until next_attempt_at (non-terminal states)
    payment_id: str | None = None
    error_class: str | None = None
    error: str | None = None
    key_status: KeyStatus | None = None  # the idempotency_keys row's new status
    dead_reason: DeadReason | None = None
    send_now: bool = False  # lookup said "never applied": send again now, same key

    @property
    def terminal(self) -> bool:
        """True for succeeded, failed and dead."""
        return self.status in TERMINAL_TX_STATUSES


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """A decision about one claimed transaction with its counters: what the worker records.

    The one type from the state machine to the database row (``db.work.record_outcomes``).
    """

    item_id: int  # transactions.id
    attempts: int  # sends so far, this step's included
    lookups: int  # lookups so far, this step's included
    decision: Decision


def _final(result: GatewayResult) -> Decision | None:
    if result.outcome is Outcome.SUCCEEDED:
        return Decision(
            TxStatus.SUCCEEDED, payment_id=result.payment_id, key_status=KeyStatus.APPLIED
        )
    if result.outcome is Outcome.DECLINED:
        return Decision(
            TxStatus.FAILED,
            error_class=result.error_class,
            error=result.error,
            key_status=KeyStatus.DECLINED,
        )
    return None


def after_send(result: GatewayResult, *, attempts: int, lookups: int, policy: Policy) -> Decision:
    """Next state after ``create_payment``; ``attempts`` counts this send."""
    final = _final(result)
    if final is not None:
        return final
    if result.outcome is Outcome.PERMANENT:
        return Decision(
            TxStatus.FAILED,
            error_class=result.error_class,
            error=result.error,
            key_status=KeyStatus.REJECTED,
        )
    if result.outcome is Outcome.RETRY:
        if attempts >= policy.max_attempts:
            return Decision(
                TxStatus.DEAD,
                error_class=result.error_class,
                error=result.error,
                key_status=KeyStatus.NOT_APPLIED,
                dead_reason=DeadReason.RETRIES_EXHAUSTED,
            )
        delay = policy.backoff.delay(attempts, floor=result.retry_after or 0.0)
        return Decision(
            TxStatus.RETRYABLE,
            delay=delay,
            error_class=result.error_class,
            error=result.error,
            key_status=KeyStatus.NOT_APPLIED,
        )
    # UNKNOWN (and anything unexpected): maybe sent. Only a lookup may decide it.
    return Decision(
        TxStatus.UNKNOWN,
        delay=policy.backoff.delay(lookups + 1),
        error_class=result.error_class,
        error=result.error,
    )


def after_lookup(result: GatewayResult, *, attempts: int, lookups: int, policy: Policy) -> Decision:
    """Next state after ``lookup_payment``; ``lookups`` counts this lookup."""
    final = _final(result)
    if final is not None:
        return final
    if result.outcome is Outcome.NOT_FOUND:
        if attempts >= policy.max_attempts:
            # never applied and out of attempts: safe to give up, nothing was paid
            return Decision(
                TxStatus.DEAD,
                error_class="not_found",
                error="never applied; attempts exhausted",
                key_status=KeyStatus.NOT_APPLIED,
                dead_reason=DeadReason.RETRIES_EXHAUSTED,
            )
        return Decision(TxStatus.UNKNOWN, send_now=True, key_status=KeyStatus.NOT_APPLIED)
    if lookups >= policy.max_lookups:
        # still unknown: never "failed", because money may have left
        return Decision(
            TxStatus.DEAD,
            error_class=result.error_class,
            error=result.error,
            dead_reason=DeadReason.UNKNOWN_UNRESOLVED,
        )
    return Decision(
        TxStatus.UNKNOWN,
        delay=policy.backoff.delay(lookups, floor=result.retry_after or 0.0),
        error_class=result.error_class,
        error=result.error,
    )
