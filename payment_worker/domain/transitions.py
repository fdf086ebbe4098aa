"""The transaction state machine of design.md, as pure functions (no I/O).

Given an item's counters and what the gateway answered, decide its next state. The
processing loop applies the decision; the repository writes it, fenced.

    pending/retryable --send--> succeeded | failed | retryable | unknown | dead
    unknown --lookup--> succeeded | failed | (not found: send again, same key) | unknown | dead
"""

from __future__ import annotations

from dataclasses import dataclass

from payment_worker.db.models import TERMINAL_TX_STATUSES
from payment_worker.domain.retry import Backoff
from payment_worker.gateway.outcomes import GatewayResult, Outcome

TERMINAL = frozenset(TERMINAL_TX_STATUSES)

# dead-letter reasons
RETRIES_EXHAUSTED = "retries_exhausted"
UNKNOWN_UNRESOLVED = "unknown_unresolved"
FINGERPRINT_MISMATCH = "fingerprint_mismatch"


@dataclass(frozen=True, slots=True)
class Policy:
    """Retry limits and timing (from settings)."""

    max_attempts: int
    max_lookups: int
    backoff: Backoff


@dataclass(frozen=True, slots=True)
class Decision:
    """The next state of one transaction, and what to write with it."""

    status: str
    delay: float = 0.0  # seconds until next_attempt_at (non-terminal states)
    payment_id: str | None = None
    error_class: str | None = None
    error: str | None = None
    key_status: str | None = None  # the idempotency_keys row's new status
    dead_reason: str | None = None
    send_now: bool = False  # lookup said "never applied": send again now, same key

    @property
    def terminal(self) -> bool:
        """True for succeeded, failed and dead."""
        return self.status in TERMINAL


def _final(result: GatewayResult) -> Decision | None:
    if result.outcome is Outcome.SUCCEEDED:
        return Decision("succeeded", payment_id=result.payment_id, key_status="applied")
    if result.outcome is Outcome.DECLINED:
        return Decision(
            "failed", error_class=result.error_class, error=result.error, key_status="declined"
        )
    return None


def after_send(result: GatewayResult, *, attempts: int, lookups: int, policy: Policy) -> Decision:
    """Next state after ``create_payment``; ``attempts`` counts this send."""
    final = _final(result)
    if final is not None:
        return final
    if result.outcome is Outcome.PERMANENT:
        return Decision(
            "failed", error_class=result.error_class, error=result.error, key_status="rejected"
        )
    if result.outcome is Outcome.RETRY:
        if attempts >= policy.max_attempts:
            return Decision(
                "dead",
                error_class=result.error_class,
                error=result.error,
                key_status="not_applied",
                dead_reason=RETRIES_EXHAUSTED,
            )
        delay = policy.backoff.delay(attempts, floor=result.retry_after or 0.0)
        return Decision(
            "retryable",
            delay=delay,
            error_class=result.error_class,
            error=result.error,
            key_status="not_applied",
        )
    # UNKNOWN (and anything unexpected): maybe sent. Only a lookup may decide it.
    return Decision(
        "unknown",
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
                "dead",
                error_class="not_found",
                error="never applied; attempts exhausted",
                key_status="not_applied",
                dead_reason=RETRIES_EXHAUSTED,
            )
        return Decision("unknown", send_now=True, key_status="not_applied")
    if lookups >= policy.max_lookups:
        # still unknown: never "failed", because money may have left
        return Decision(
            "dead",
            error_class=result.error_class,
            error=result.error,
            dead_reason=UNKNOWN_UNRESOLVED,
        )
    return Decision(
        "unknown",
        delay=policy.backoff.delay(lookups, floor=result.retry_after or 0.0),
        error_class=result.error_class,
        error=result.error,
    )
