"""The state machine's decisions, row by row (no services)."""

from __future__ import annotations

import random

import pytest

from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.retry import Backoff
from payment_worker.domain.statuses import DeadReason, KeyStatus, TxStatus
from payment_worker.domain.transitions import (
    Doubt,
    Policy,
    after_conflict,
    after_lookup,
    after_send,
    too_late_to_send,
)
from payment_worker.gateway.outcomes import GatewayResult, Outcome

POLICY = Policy(
    max_attempts=3,
    backoff=Backoff(base=1.0, cap=10.0),
    lookup_backoff=Backoff(base=1.0, cap=5.0),
    retry_after_max=300.0,
    in_doubt_max=3600.0,
    key_trust=77760.0,  # 0.9 x 24 h
)
REQ = PaymentRequest("acct-1", "tx-1", 150_000, "IDR", {"bank_code": "014"})


def r(outcome: Outcome, status: int | None = None, **kw: object) -> GatewayResult:
    return GatewayResult(outcome=outcome, http_status=status, **kw)  # type: ignore[arg-type]


def send(result: GatewayResult, attempts: int = 1, **kw: object) -> object:
    return after_send(result, attempts=attempts, lookups=0, policy=POLICY, **kw)  # type: ignore[arg-type]


def look(
    result: GatewayResult, doubt_age: float | None = 10.0, attempts: int = 1, lookups: int = 1
):  # type: ignore[no-untyped-def]
    return after_lookup(
        result, attempts=attempts, lookups=lookups, doubt_age=doubt_age, policy=POLICY
    )


def test_send_success_and_decline_are_final() -> None:
    d = after_send(r(Outcome.SUCCEEDED, 201, payment_id="p1"), attempts=1, lookups=0, policy=POLICY)
    assert (d.status, d.payment_id, d.key_status, d.terminal) == (
        "succeeded",
        "p1",
        "applied",
        True,
    )
    d = after_send(
        r(Outcome.DECLINED, 402, reason="insufficient_funds"), attempts=1, lookups=0, policy=POLICY
    )
    assert (d.status, d.error_class, d.key_status) == (
        "failed",
        "declined:insufficient_funds",
        "declined",
    )


def test_400_is_failed_nothing_was_applied() -> None:
    d = after_send(r(Outcome.PERMANENT, 400), attempts=1, lookups=0, policy=POLICY)
    assert (d.status, d.key_status) == ("failed", "rejected")


def test_not_applied_backs_off_with_retry_after_as_floor_then_dies() -> None:
    d = after_send(r(Outcome.RETRY, 429, retry_after=7.0), attempts=1, lookups=0, policy=POLICY)
    assert d.status == "retryable" and d.delay >= 7.0 and d.doubt is Doubt.KEEP
    d = after_send(r(Outcome.RETRY, 503), attempts=2, lookups=0, policy=POLICY)
    assert d.status == "retryable" and 0.0 <= d.delay <= 2.0
    d = after_send(r(Outcome.RETRY, 503), attempts=3, lookups=0, policy=POLICY)
    assert (d.status, d.dead_reason, d.key_status) == ("dead", "retries_exhausted", "not_applied")


def test_retry_after_is_honoured_up_to_its_cap() -> None:
    d = after_send(
        r(Outcome.RETRY, 429, retry_after=172800.0), attempts=1, lookups=0, policy=POLICY
    )
    assert 300.0 <= d.delay <= 300.0 + 1.0
    d = look(r(Outcome.RETRY, 429, retry_after=172800.0))
    assert d.status == "unknown" and 300.0 <= d.delay < 400.0


def test_a_request_that_never_left_uses_up_no_attempt() -> None:
    # the drain passes attempts without this send; out of attempts only counts real sends
    d = after_send(r(Outcome.RETRY, None, sent=False), attempts=3, lookups=0, policy=POLICY)
    assert d.status == "retryable"


@pytest.mark.parametrize(
    ("outcome", "status"),
    [
        (Outcome.UNKNOWN, None),
        (Outcome.UNKNOWN, 409),
        (Outcome.UNKNOWN, 200),
        (Outcome.UNKNOWN, 504),
    ],
)
def test_maybe_sent_is_unknown_never_failed_even_on_the_last_attempt(
    outcome: Outcome, status: int | None
) -> None:
    d = after_send(r(outcome, status), attempts=3, lookups=0, policy=POLICY)
    assert (d.status, d.dead_reason, d.doubt) == ("unknown", None, Doubt.SINCE_DISPATCH)
    d = after_send(r(outcome, status), attempts=3, lookups=0, policy=POLICY, cleared=True)
    assert d.doubt is Doubt.RESET_TO_DISPATCH


def test_lookup_final_answers_decide() -> None:
    d = look(r(Outcome.SUCCEEDED, 200, payment_id="p9"))
    assert (d.status, d.payment_id, d.key_status) == ("succeeded", "p9", "applied")
    assert look(r(Outcome.DECLINED, 200)).status == "failed"


def test_lookup_404_within_the_retention_sends_again_and_clears_the_doubt() -> None:
    d = look(r(Outcome.NOT_FOUND, 404), doubt_age=77759.0)
    assert (d.status, d.send_now, d.key_status, d.doubt) == (
        "unknown",
        True,
        "not_applied",
        Doubt.CLEAR,
    )


def test_lookup_404_past_the_retention_never_sends() -> None:
    d = look(r(Outcome.NOT_FOUND, 404), doubt_age=77760.0)
    assert (d.status, d.send_now, d.dead_reason) == ("dead", False, "in_doubt_key_expired")


def test_lookup_404_and_out_of_attempts_goes_dead_as_not_applied() -> None:
    d = look(r(Outcome.NOT_FOUND, 404), attempts=3)
    assert (d.status, d.dead_reason, d.key_status) == ("dead", "retries_exhausted", "not_applied")


@pytest.mark.parametrize(
    "result",
    [
        r(Outcome.IN_FLIGHT, 409),
        r(Outcome.RETRY, 429, retry_after=2.0),
        r(Outcome.RETRY, 503),
        r(Outcome.UNKNOWN, 500),
        r(Outcome.UNKNOWN, None, reason="timeout"),
        r(Outcome.RETRY, None, sent=False),
    ],
)
def test_no_final_answer_keeps_waiting_in_time_not_in_lookups(result: GatewayResult) -> None:
    # a hundred lookups in, ten minutes in doubt: still patient
    d = look(result, doubt_age=600.0, lookups=100)
    assert (d.status, d.dead_reason, d.doubt) == ("unknown", None, Doubt.KEEP)
    assert d.delay <= 5.0 + (result.retry_after or 0.0)
    # an hour in doubt: a person decides
    d = look(result, doubt_age=3600.0, lookups=2)
    assert (d.status, d.dead_reason) == ("dead", "unknown_unresolved")


def test_conflict_matching_stored_payment_is_ours() -> None:
    stored = {"transaction_id": "tx-1", "amount": 150_000, "currency": "IDR", "payment_id": "p1"}
    found = r(Outcome.SUCCEEDED, 200, payment_id="p1", stored=stored)
    d = after_conflict(found, REQ, lookups=1, doubt_age=None, policy=POLICY)
    assert (d.status, d.payment_id) == (TxStatus.SUCCEEDED, "p1")


@pytest.mark.parametrize(
    "stored",
    [
        {"transaction_id": "tx-2", "amount": 150_000, "currency": "IDR"},
        {"transaction_id": "tx-1", "amount": 1, "currency": "IDR"},
        {"transaction_id": "tx-1", "amount": 150_000, "currency": "USD"},
    ],
)
def test_conflict_with_another_stored_payment_is_a_key_conflict(stored: dict[str, object]) -> None:
    found = r(Outcome.SUCCEEDED, 200, payment_id="p1", stored=stored)
    d = after_conflict(found, REQ, lookups=1, doubt_age=None, policy=POLICY)
    assert (d.status, d.dead_reason) == (TxStatus.DEAD, DeadReason.KEY_CONFLICT)
    assert "tx-" in (d.error or "")  # what the gateway holds is kept for on-call


def test_conflict_with_a_stored_decline_is_failed() -> None:
    d = after_conflict(r(Outcome.DECLINED, 200), REQ, lookups=1, doubt_age=None, policy=POLICY)
    assert (d.status, d.key_status) == (TxStatus.FAILED, KeyStatus.DECLINED)


def test_conflict_whose_lookup_has_no_answer_stays_in_doubt() -> None:
    d = after_conflict(r(Outcome.IN_FLIGHT, 409), REQ, lookups=1, doubt_age=5.0, policy=POLICY)
    # its key remembered as in conflict: every later lookup is judged by after_conflict
    assert (d.status, d.doubt, d.key_status) == (
        TxStatus.UNKNOWN,
        Doubt.SINCE_DISPATCH,
        KeyStatus.CONFLICT,
    )


def test_a_404_after_a_conflict_is_for_a_person_never_a_resend() -> None:
    # the gateway held another body under the key, and forgot it since: what it held may
    # have been a payment of this very transaction
    d = after_conflict(r(Outcome.NOT_FOUND, 404), REQ, lookups=3, doubt_age=60.0, policy=POLICY)
    assert (d.status, d.send_now, d.dead_reason) == (TxStatus.DEAD, False, "key_conflict")


def test_a_conflict_in_doubt_past_the_in_doubt_bound_dies_with_its_key_still_in_conflict() -> None:
    # an unknown_unresolved item may be replayed: its lookup must be judged as after a 422
    d = after_conflict(r(Outcome.RETRY, 503), REQ, lookups=9, doubt_age=3600.0, policy=POLICY)
    assert (d.status, d.dead_reason, d.key_status) == (
        TxStatus.DEAD,
        "unknown_unresolved",
        KeyStatus.CONFLICT,
    )


@pytest.mark.parametrize(("age", "late"), [(None, False), (0.0, False), (77759.0, False)])
def test_an_item_never_in_doubt_or_within_the_key_trust_may_be_sent(
    age: float | None, late: bool
) -> None:
    assert (too_late_to_send(age, POLICY) is not None) is late


def test_an_item_once_in_doubt_past_the_key_trust_is_never_sent_again() -> None:
    # a 404 cleared that doubt, but the send in doubt may have landed after it, and the
    # gateway may have forgotten its key since
    d = too_late_to_send(77760.0, POLICY)
    assert d is not None
    # a replay refuses it too: the dlq commands date its doubt from that first one
    assert (d.status, d.dead_reason, d.send_now) == (TxStatus.DEAD, "in_doubt_key_expired", False)


def test_backoff_is_full_jitter_capped() -> None:
    b = Backoff(base=1.0, cap=10.0)
    rng = random.Random(7)
    for n in range(1, 20):
        d = b.delay(n, rng=rng)
        assert 0.0 <= d <= min(10.0, 2 ** (n - 1))
    assert b.ceiling(100) == 10.0
    assert b.delay(1, floor=30.0) == 30.0


def test_a_lookup_finding_our_payment_is_a_success() -> None:
    for stored in (
        {"transaction_id": "tx-1", "amount": 150_000, "currency": "IDR"},
        {"transaction_id": "tx-1", "amount": "150000", "currency": "IDR"},  # a string amount
        {"payment_id": "p1"},  # a gateway that leaves the fields out proves nothing either way
        None,
    ):
        found = r(Outcome.SUCCEEDED, 200, payment_id="p1", stored=stored)
        d = after_lookup(found, attempts=1, lookups=1, doubt_age=5.0, policy=POLICY, request=REQ)
        assert (d.status, d.payment_id) == (TxStatus.SUCCEEDED, "p1"), stored


@pytest.mark.parametrize(
    "stored",
    [
        {"transaction_id": "tx-2", "amount": 150_000, "currency": "IDR"},
        {"transaction_id": "tx-1", "amount": 1, "currency": "IDR"},
        {"transaction_id": "tx-1", "amount": "1.5", "currency": "IDR"},
        {"transaction_id": "tx-1", "amount": 150_000, "currency": "USD"},
        {"amount": 99},
    ],
)
def test_a_lookup_finding_another_payment_under_our_key_is_a_key_conflict(
    stored: dict[str, object],
) -> None:
    """A 422 whose own lookup got no answer left the item merely in doubt; when it is looked
    up again, a stored payment that is not ours must not be taken for it (a review found the
    later lookup accepted any stored 201)."""
    found = r(Outcome.SUCCEEDED, 200, payment_id="p9", stored=stored)
    d = after_lookup(found, attempts=1, lookups=2, doubt_age=5.0, policy=POLICY, request=REQ)
    assert (d.status, d.dead_reason) == (TxStatus.DEAD, DeadReason.KEY_CONFLICT)
    assert d.payment_id is None


def test_a_conflicts_stored_payment_is_ours_only_when_every_field_says_so() -> None:
    partial = {"transaction_id": "tx-1", "amount": 150_000}  # no currency: not proven
    found = r(Outcome.SUCCEEDED, 200, payment_id="p1", stored=partial)
    d = after_conflict(found, REQ, lookups=1, doubt_age=None, policy=POLICY)
    assert (d.status, d.dead_reason) == (TxStatus.DEAD, DeadReason.KEY_CONFLICT)
    as_text = {"transaction_id": "tx-1", "amount": "150000", "currency": "IDR"}
    found = r(Outcome.SUCCEEDED, 200, payment_id="p1", stored=as_text)
    d = after_conflict(found, REQ, lookups=1, doubt_age=None, policy=POLICY)
    assert d.status is TxStatus.SUCCEEDED
