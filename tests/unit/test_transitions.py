"""The state machine's decisions, row by row (no services)."""

from __future__ import annotations

import random

import pytest

from payment_worker.domain.retry import Backoff
from payment_worker.domain.statuses import DeadReason
from payment_worker.domain.transitions import Policy, after_lookup, after_send
from payment_worker.gateway.outcomes import GatewayResult, Outcome

POLICY = Policy(max_attempts=3, max_lookups=2, backoff=Backoff(base=1.0, cap=10.0))


def r(outcome: Outcome, status: int | None = None, **kw: object) -> GatewayResult:
    return GatewayResult(outcome=outcome, http_status=status, **kw)  # type: ignore[arg-type]


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
    assert (d.status, d.key_status) == ("failed", "declined")
    d = after_send(r(Outcome.PERMANENT, 422), attempts=1, lookups=0, policy=POLICY)
    assert d.status == "failed"


def test_retry_backs_off_and_honours_retry_after() -> None:
    d = after_send(r(Outcome.RETRY, 429, retry_after=7.0), attempts=1, lookups=0, policy=POLICY)
    assert d.status == "retryable" and d.delay >= 7.0
    d = after_send(r(Outcome.RETRY, 503), attempts=2, lookups=0, policy=POLICY)
    assert d.status == "retryable" and 0.0 <= d.delay <= 2.0


def test_retries_exhausted_goes_dead_with_reason() -> None:
    d = after_send(r(Outcome.RETRY, 503), attempts=3, lookups=0, policy=POLICY)
    assert (d.status, d.dead_reason) == ("dead", DeadReason.RETRIES_EXHAUSTED)


def test_unknown_is_never_failed() -> None:
    d = after_send(r(Outcome.UNKNOWN, None), attempts=3, lookups=0, policy=POLICY)
    assert d.status == "unknown"  # even out of attempts: only a lookup decides
    d = after_lookup(r(Outcome.IN_FLIGHT, 409), attempts=1, lookups=1, policy=POLICY)
    assert d.status == "unknown"
    d = after_lookup(r(Outcome.UNKNOWN, None), attempts=1, lookups=2, policy=POLICY)
    assert (d.status, d.dead_reason) == ("dead", DeadReason.UNKNOWN_UNRESOLVED)


def test_lookup_outcomes() -> None:
    d = after_lookup(
        r(Outcome.SUCCEEDED, 200, payment_id="p"), attempts=1, lookups=1, policy=POLICY
    )
    assert (d.status, d.payment_id) == ("succeeded", "p")
    d = after_lookup(r(Outcome.DECLINED, 200), attempts=1, lookups=1, policy=POLICY)
    assert d.status == "failed"
    d = after_lookup(r(Outcome.NOT_FOUND, 404), attempts=1, lookups=1, policy=POLICY)
    assert d.send_now and d.status == "unknown"
    d = after_lookup(r(Outcome.NOT_FOUND, 404), attempts=3, lookups=1, policy=POLICY)
    assert (d.status, d.dead_reason) == ("dead", DeadReason.RETRIES_EXHAUSTED)


@pytest.mark.parametrize("attempt", [1, 2, 5, 10, 80])
def test_backoff_full_jitter_within_cap(attempt: int) -> None:
    b = Backoff(base=0.5, cap=30.0)
    rng = random.Random(attempt)
    values = [b.delay(attempt, rng=rng) for _ in range(200)]
    assert all(0.0 <= v <= min(30.0, 0.5 * 2 ** (attempt - 1)) for v in values)
    assert len({round(v, 6) for v in values}) > 150  # jittered, not fixed


def test_backoff_floor_beats_cap() -> None:
    assert Backoff(base=1.0, cap=2.0).delay(1, floor=5.0) >= 5.0
