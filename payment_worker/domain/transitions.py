"""The transaction state machine of docs/architecture.md, as pure functions (no I/O).

Given an item's counters, how long it has been in doubt, and what the gateway answered,
decide its next state. The drain loop applies the decision; the repository writes it, fenced.

    pending/retryable --send--> succeeded | failed | retryable | unknown | dead
    send answered 422 --lookup--> succeeded | failed | unknown | dead (key_conflict)
    unknown --lookup--> succeeded | failed | (not found in time: send again, same key)
                        | unknown (look again later) | dead

"Maybe sent" is measured in time: every item in doubt carries the time of its oldest send
whose outcome is not known (``doubt_since`` in the database; its age reaches these
functions as ``doubt_age``). A lookup 404 proves "never applied" only while that age is
below what the gateway is trusted to remember (:attr:`Policy.key_trust`); past it the item
is never sent again automatically. Lookups that get no final answer use up nothing but
time, until :attr:`Policy.in_doubt_max`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.retry import Backoff
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES, DeadReason, KeyStatus, TxStatus
from payment_worker.gateway.outcomes import GatewayResult, Outcome, held_text


@dataclass(frozen=True, slots=True)
class Policy:
    """Limits and timing (from settings)."""

    max_attempts: int  # sends answered "not applied" before dead (retries_exhausted)
    backoff: Backoff  # between sends
    lookup_backoff: Backoff  # between lookups of an item in doubt (capped)
    retry_after_max: float  # a Retry-After is honoured up to this long
    in_doubt_max: float  # seconds in doubt before dead (unknown_unresolved)
    key_trust: float  # seconds after a send within which a 404 proves "never applied"

    def retry_after(self, result: GatewayResult) -> float:
        """The answer's Retry-After, capped: the floor of the next attempt."""
        return min(result.retry_after or 0.0, self.retry_after_max)


class Doubt(StrEnum):
    """What a step does to the item's oldest send in doubt (``doubt_since``)."""

    KEEP = "keep"  # nothing new is in doubt, nothing was cleared
    SINCE_DISPATCH = "since_dispatch"  # this step's send is in doubt (the older one stays)
    RESET_TO_DISPATCH = "reset"  # a 404 cleared the old doubt; this step's send is in doubt
    CLEAR = "clear"  # a 404 cleared the old doubt and nothing new is in doubt


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
    send_now: bool = False  # lookup proved "never applied": send again now, same key
    doubt: Doubt = Doubt.KEEP

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
    attempts: int  # sends that reached the gateway, this step's included
    lookups: int  # lookups that reached the gateway, this step's included
    decision: Decision
    # whether a request of this step (a send or a lookup) reached the gateway. A step that
    # reached nothing uses up nothing, so an open item's ``unsent_since`` dates how long it
    # has been retried in vain; an item given back untouched at a shutdown counts as such
    # (a stall is never hidden; the next holder's send clears it)
    reached: bool = False

    @property
    def unsent(self) -> bool:
        """True when the item stays open and nothing of this step reached the gateway."""
        return not self.reached and not self.decision.terminal


def _final(result: GatewayResult) -> Decision | None:
    # the outcome is known: nothing is in doubt any more
    if result.outcome is Outcome.SUCCEEDED:
        return Decision(
            TxStatus.SUCCEEDED,
            payment_id=result.payment_id,
            key_status=KeyStatus.APPLIED,
            doubt=Doubt.CLEAR,
        )
    if result.outcome is Outcome.DECLINED:
        return Decision(
            TxStatus.FAILED,
            error_class=result.error_class,
            error=result.error,
            key_status=KeyStatus.DECLINED,
            doubt=Doubt.CLEAR,
        )
    return None


def after_send(
    result: GatewayResult,
    *,
    attempts: int,
    lookups: int,
    policy: Policy,
    cleared: bool = False,
) -> Decision:
    """Next state after ``create_payment``.

    ``attempts`` counts this send if it reached the gateway; ``cleared`` says a lookup of
    this step proved the earlier sends never applied. A 422 is not decided here: the caller
    looks the key up and calls :func:`after_conflict`.
    """
    final = _final(result)
    if final is not None:
        return final
    if result.outcome is Outcome.PERMANENT:
        # 400: malformed, nothing applied; never "failed" for anything that may have paid
        return Decision(
            TxStatus.FAILED,
            error_class=result.error_class,
            error=result.error,
            key_status=KeyStatus.REJECTED,
        )
    if result.outcome is Outcome.RETRY:
        doubt = Doubt.CLEAR if cleared else Doubt.KEEP
        if result.sent and attempts >= policy.max_attempts:
            return Decision(
                TxStatus.DEAD,
                error_class=result.error_class,
                error=result.error,
                key_status=KeyStatus.NOT_APPLIED,
                dead_reason=DeadReason.RETRIES_EXHAUSTED,
                doubt=doubt,
            )
        delay = policy.backoff.delay(max(attempts, 1), floor=policy.retry_after(result))
        return Decision(
            TxStatus.RETRYABLE,
            delay=delay,
            error_class=result.error_class,
            error=result.error,
            key_status=KeyStatus.NOT_APPLIED,
            doubt=doubt,
        )
    # UNKNOWN (409, an odd 2xx, timeouts, 500/502/504, anything unexpected): maybe sent.
    # Only a lookup may decide it.
    return Decision(
        TxStatus.UNKNOWN,
        delay=policy.lookup_backoff.delay(lookups + 1, floor=policy.retry_after(result)),
        error_class=result.error_class,
        error=result.error,
        doubt=Doubt.RESET_TO_DISPATCH if cleared else Doubt.SINCE_DISPATCH,
    )


def _still_in_doubt(
    result: GatewayResult, *, lookups: int, doubt_age: float | None, policy: Policy, doubt: Doubt
) -> Decision:
    """No final answer: look again later, or give up once in doubt for too long."""
    if doubt_age is not None and doubt_age >= policy.in_doubt_max:
        # still unknown: never "failed", because money may have left; a person decides
        return Decision(
            TxStatus.DEAD,
            error_class=result.error_class,
            error=result.error,
            dead_reason=DeadReason.UNKNOWN_UNRESOLVED,
            doubt=doubt,
        )
    return Decision(
        TxStatus.UNKNOWN,
        delay=policy.lookup_backoff.delay(max(lookups, 1), floor=policy.retry_after(result)),
        error_class=result.error_class,
        error=result.error,
        doubt=doubt,
    )


def after_lookup(
    result: GatewayResult,
    *,
    attempts: int,
    lookups: int,
    doubt_age: float | None,
    policy: Policy,
    request: PaymentRequest | None = None,
) -> Decision:
    """Next state after ``lookup_payment`` of an item in doubt.

    ``lookups`` counts this lookup if it reached the gateway; ``doubt_age`` is the age of
    the oldest send in doubt (None: nothing recorded; the claim dates every item it takes
    for a lookup, so the drain never passes None). With ``request`` (the drain's), a stored
    payment that names another transaction id, amount or currency is not ours: a key
    conflict for a person, never a success. (That is how a key used by another body, seen
    as a 422 whose own lookup got no answer, is still caught when the item is looked up
    again.)
    """
    final = _final(result)
    if final is not None:
        if (
            request is not None
            and result.outcome is Outcome.SUCCEEDED
            and _names_another_payment(result.stored, request)
        ):
            return _key_conflict(result, "the stored payment under our key is not ours", Doubt.KEEP)
        return final
    if result.outcome is Outcome.NOT_FOUND:
        if doubt_age is not None and doubt_age >= policy.key_trust:
            # the gateway may have forgotten the key: a 404 proves nothing any more, and a
            # send now could pay a second time. Never resend automatically.
            return Decision(
                TxStatus.DEAD,
                error_class="not_found_after_retention",
                error=f"lookup 404 {doubt_age:.0f}s after the oldest send in doubt; the "
                "gateway may have forgotten the key: check with the gateway, resolve by hand",
                dead_reason=DeadReason.IN_DOUBT_KEY_EXPIRED,
            )
        if attempts >= policy.max_attempts:
            # never applied and out of attempts: safe to give up, nothing was paid
            return Decision(
                TxStatus.DEAD,
                error_class="not_found",
                error="never applied; attempts exhausted",
                key_status=KeyStatus.NOT_APPLIED,
                dead_reason=DeadReason.RETRIES_EXHAUSTED,
                doubt=Doubt.CLEAR,
            )
        return Decision(
            TxStatus.UNKNOWN, send_now=True, key_status=KeyStatus.NOT_APPLIED, doubt=Doubt.CLEAR
        )
    return _still_in_doubt(
        result, lookups=lookups, doubt_age=doubt_age, policy=policy, doubt=Doubt.KEEP
    )


def after_conflict(
    found: GatewayResult,
    request: PaymentRequest,
    *,
    lookups: int,
    doubt_age: float | None,
    policy: Policy,
) -> Decision:
    """Next state after a create answered 422 and the lookup of its key.

    The gateway holds an answer under this key. A stored 201 of this very transaction
    (same transaction id, amount, currency) is our payment; a stored 402 is a decline;
    anything else stored is a conflict a person must look at. No final answer yet: still in
    doubt (the 422 says something is stored), looked up again later, and its key marked
    ``conflict``, so that every later lookup of it is judged here too: a 404 after a 422
    means the gateway forgot what it held (a payment, maybe), never "send again".
    """
    # after a 422 ours must be proven: every field present, none naming another payment
    stored = found.stored or {}
    ours = all(
        stored.get(k) is not None for k in ("transaction_id", "amount", "currency")
    ) and not _names_another_payment(stored, request)
    final = _final(found)
    if final is not None and (found.outcome is Outcome.DECLINED or ours):
        return final
    if final is None and found.outcome is not Outcome.NOT_FOUND:
        d = _still_in_doubt(
            found, lookups=lookups, doubt_age=doubt_age, policy=policy, doubt=Doubt.SINCE_DISPATCH
        )
        # kept when it dies unresolved too: its replay's lookup is judged here as well
        return replace(d, key_status=KeyStatus.CONFLICT)
    return _key_conflict(found, "422 idempotency_key_reused", Doubt.SINCE_DISPATCH)


def too_late_to_send(first_doubt_age: float | None, policy: Policy) -> Decision | None:
    """A person's decision instead of a send, once the item's first send ever in doubt is
    older than the key trust (``first_doubt_age``, seconds; None: none was), else None.

    A lookup's 404 clears the doubt of the sends before it, but one of them may still land
    after it (a paused holder's); past the gateway's retention the key that would catch a
    resend is forgotten, and the resend pays a second time. Sends that were all answered
    "nothing applied" (503, 429, refused) were never in doubt: such an item is sent at
    any age."""
    if first_doubt_age is None or first_doubt_age < policy.key_trust:
        return None
    return Decision(
        TxStatus.DEAD,
        error_class="doubt_past_key_trust",
        error=f"a send of it was in doubt {first_doubt_age:.0f}s ago: the gateway may have "
        "forgotten the key, and a send now could pay a second time: check with the gateway, "
        "resolve by hand",
        dead_reason=DeadReason.IN_DOUBT_KEY_EXPIRED,
    )


def _names_another_payment(stored: dict[str, object] | None, request: PaymentRequest) -> bool:
    """Whether a stored 201 body positively names another payment: a transaction id, an
    amount or a currency present and different from ours (an amount compared as a number,
    so ``"150000"`` is 150000). A field a gateway leaves out proves nothing."""
    if not stored:
        return False
    tx, amount, currency = (stored.get(k) for k in ("transaction_id", "amount", "currency"))
    if tx is not None and str(tx) != request.transaction_id:
        return True
    if currency is not None and str(currency) != request.currency:
        return True
    if amount is None or isinstance(amount, bool):
        return amount is not None  # a boolean amount is nobody's
    try:
        return int(str(amount)) != request.amount
    except ValueError:
        return True  # not a whole number of minor units: not what we sent


def _key_conflict(found: GatewayResult, what: str, doubt: Doubt) -> Decision:
    held = held_text(found)  # masked: a stored answer may echo the beneficiary
    return Decision(
        TxStatus.DEAD,
        error_class="key_conflict",
        error=f"{what}; the gateway holds: {held}",
        key_status=KeyStatus.CONFLICT,
        dead_reason=DeadReason.KEY_CONFLICT,
        doubt=doubt,
    )


def handed_back(status: TxStatus) -> Decision:
    """A claimed item given back untouched because its holder is shutting down (issue 15):
    due again at once, in the state it was claimed into. An item claimed for a lookup
    (``unknown``) stays in doubt; one claimed to be sent (``dispatching``) was never sent, so
    it is ``retryable`` and its key ``not_applied`` (the caller gives the attempt back)."""
    if status is TxStatus.UNKNOWN:
        return Decision(
            TxStatus.UNKNOWN, error_class="handed_back", error="not looked up: shutdown"
        )
    return Decision(
        TxStatus.RETRYABLE,
        error_class="handed_back",
        error="not sent: shutdown",
        key_status=KeyStatus.NOT_APPLIED,
    )
