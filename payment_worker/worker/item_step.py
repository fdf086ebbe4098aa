"""One claimed item's step: the gateway calls it takes and the decision they lead to.

The drain loop (:mod:`payment_worker.worker.drain`) calls :func:`step_item` for each item
of a chunk and records the outcomes; nothing here touches the database or the lock (the
``guard`` the caller gives checks the lock right before each request leaves).
"""

from __future__ import annotations

from payment_worker.db.work import ClaimedItem
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.statuses import DeadReason, KeyStatus, TxStatus
from payment_worker.domain.transitions import (
    Decision,
    ItemOutcome,
    Policy,
    after_conflict,
    after_lookup,
    after_send,
    too_late_to_send,
)
from payment_worker.gateway.outcomes import Outcome
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import LOOKUPS
from payment_worker.worker.ports import Gateway, Guard

log = get_logger("processing")


def step_item(gateway: Gateway, policy: Policy, guard: Guard, item: ClaimedItem) -> ItemOutcome:
    """One claimed item's step: send it, or look it up first when its last send is in
    doubt, and decide its next state (:mod:`payment_worker.domain.transitions`).
    ``guard`` runs right before each request leaves."""
    request = PaymentRequest(
        account_id=item.account_id,
        transaction_id=item.transaction_id,
        amount=item.amount,
        currency=item.currency,
        beneficiary=item.beneficiary,
        description=item.description,
    )
    attempts, lookups = item.attempts, item.lookups
    fingerprint = item.request_fingerprint
    if fingerprint is not None and request.fingerprint() != fingerprint:
        # the row no longer matches what was accepted: never send another body under the key
        d = Decision(
            TxStatus.DEAD,
            error_class="fingerprint_mismatch",
            error="request body differs from the accepted one",
            dead_reason=DeadReason.FINGERPRINT_MISMATCH,
        )
        return ItemOutcome(item.id, attempts, lookups, d)
    cleared = False  # a lookup of this step proved the earlier sends never applied
    reached = False  # a request of this step reached the gateway
    # the guard (ensure_held(), then progress) runs inside the client right before each
    # send, after any token or pacing wait; held: this holder is the account's only
    # sender, so its pacing goes on past a lease without a round trip
    if item.status is TxStatus.UNKNOWN:
        found = gateway.lookup_payment(
            item.account_id, item.idempotency_key, guard=guard, held=True
        )
        lookups += found.sent  # a lookup that never left uses up nothing
        reached = found.sent
        LOOKUPS.labels(found.outcome.value).inc()
        log.info(
            "in_doubt_lookup",
            outcome=found.outcome.value,
            sent=found.sent,
            doubt_age=item.doubt_age,
            lookups=lookups,
        )
        if item.key_status == KeyStatus.CONFLICT:
            # a 422's item: the gateway held another body under the key; a 404 now means
            # it forgot what it held, and is for a person
            d = after_conflict(
                found, request, lookups=lookups, doubt_age=item.doubt_age, policy=policy
            )
        else:
            d = after_lookup(
                found,
                attempts=attempts,
                lookups=lookups,
                doubt_age=item.doubt_age,
                policy=policy,
                request=request,
            )
        if not d.send_now:
            return ItemOutcome(item.id, attempts, lookups, d, reached)
        cleared = True
        attempts += 1  # never applied: send again under the same key
    late = too_late_to_send(item.first_doubt_age, policy)
    if late is not None:
        # nothing leaves: the attempt counted for this send (at the claim, or above) is
        # given back
        return ItemOutcome(item.id, attempts - 1, lookups, late, reached)
    result = gateway.create_payment(
        item.account_id, request, item.idempotency_key, guard=guard, held=True
    )
    if not result.sent:
        attempts -= 1  # counted at the claim (or above), but nothing left
    reached = reached or result.sent
    if result.outcome is Outcome.CONFLICT:
        # 422: the gateway holds an answer under this key; what it holds decides
        found = gateway.lookup_payment(
            item.account_id, item.idempotency_key, guard=guard, held=True
        )
        lookups += found.sent
        LOOKUPS.labels(found.outcome.value).inc()
        log.info("key_conflict_lookup", outcome=found.outcome.value, sent=found.sent)
        d = after_conflict(found, request, lookups=lookups, doubt_age=item.doubt_age, policy=policy)
        return ItemOutcome(item.id, attempts, lookups, d, reached)
    d = after_send(result, attempts=attempts, lookups=lookups, policy=policy, cleared=cleared)
    return ItemOutcome(item.id, attempts, lookups, d, reached)


def log_outcome(d: Decision) -> None:
    """One line per item that did not succeed (a success is a debug line: the hot path)."""
    if d.status is TxStatus.SUCCEEDED:
        log.debug("item_succeeded")
    elif d.status is TxStatus.DEAD:
        log.error(
            "dead_letter",
            reason=d.dead_reason.value if d.dead_reason else None,
            error_class=d.error_class,
            error=d.error,
        )
    elif d.status is TxStatus.FAILED:
        log.info("item_failed", reason=d.error_class, error=d.error)
    else:
        # retryable (nothing applied) or unknown (maybe sent: looked up next)
        log.info(
            "item_retry",
            status=d.status.value,
            reason=d.error_class,
            delay=round(d.delay, 3),
            error=d.error,
        )
