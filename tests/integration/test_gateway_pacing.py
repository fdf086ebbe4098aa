"""Per-account pacing in Redis: the quota across threads, and a 429's Retry-After in any process."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.gateway import Outcome
from payment_worker.gateway.pacing import Pacer
from payment_worker.settings import Settings
from tests.conftest import PwEnv
from tests.sim_fixtures import SimHandle, gateway_client, run_bursts


def tx(account: str, tx_id: str) -> PaymentRequest:
    return PaymentRequest(
        account_id=account,
        transaction_id=tx_id,
        amount=1000,
        currency="IDR",
        beneficiary={"bank_code": "014", "account_number": "1234567890", "name": "Budi"},
    )


def test_429_retry_after_holds_every_process_and_only_that_account(
    pw_env: PwEnv, gateway_sim: SimHandle
) -> None:
    # this test is about Retry-After and pacing, not the in-flight limit: its threads are not
    # coordinated by an account lock, so two requests paced 50 ms apart may still overlap at
    # the gateway when one waits longer for its first connection (seen on a loaded machine)
    gateway_sim.configure(max_in_flight=10)
    client = gateway_client(Settings())
    # tokens for both accounts first, so that the timing below is pacing only
    for acct in ("acct-a", "acct-b"):
        assert client.lookup_payment(acct, "pw1-warm").outcome is Outcome.NOT_FOUND
    first: dict[str, Any] = {}

    def rate_limited_now() -> None:
        gateway_sim.script("acct-a", {"fault": "429", "retry_after": 2, "endpoint": "create"})
        p = tx("acct-a", "first")
        first["result"] = client.create_payment("acct-a", p, p.idempotency_key)

    specs = [
        {"threads": 2, "account_id": "acct-a", "tx_prefix": "p1"},
        {"threads": 2, "account_id": "acct-a", "tx_prefix": "p2"},
        {"threads": 3, "account_id": "acct-b", "tx_prefix": "p3"},
    ]
    started, results = run_bursts(specs, before_go=rate_limited_now)
    client.close()
    res = first["result"]
    assert (res.outcome, res.http_status, res.retry_after) == (Outcome.RETRY, 429, 2.0)

    log_a = [r for r in gateway_sim.requests("acct-a") if r[1] == "create"]
    t_429 = next(t for t, _, status in log_a if status == 429)
    after = [t for t, _, status in log_a if t > t_429]
    assert len(after) == 4 and all(status == 201 for _, _, status in log_a[1:])
    assert min(after) - t_429 >= 2.0  # nobody, in any process, before Retry-After

    calls = [c for proc in results for c in proc]
    assert all(c["outcome"] == "succeeded" for c in calls), calls
    b_done = max(c["t1"] for c in calls if c["account"] == "acct-b")
    a_done = min(c["t1"] for c in calls if c["account"] == "acct-a")
    assert b_done - started < 1.0  # the other account was not slowed
    assert a_done > b_done
    assert gateway_sim.ledger()["http_429_by_cause"]["rate"] == 0


def test_the_bucket_spaces_requests_of_one_account_across_threads(
    redis_client: redis.Redis,
) -> None:
    pacer = Pacer(redis_client, prefix="pw")
    granted: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(8):
            assert pacer.acquire("acct-1", rate=40, max_wait=10).acquired
            with lock:
                granted.append(time.monotonic())

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    granted.sort()
    assert len(granted) == 24
    # burst 1 at 40/s: 23 intervals of 25 ms at least (a few ms of scheduling slack)
    assert granted[-1] - granted[0] >= 23 / 40 - 0.03


def test_accounts_have_separate_buckets(redis_client: redis.Redis) -> None:
    pacer = Pacer(redis_client, prefix="pw")
    assert pacer.try_acquire("acct-1", rate=1) == 0.0
    assert pacer.try_acquire("acct-1", rate=1) > 0.5
    assert pacer.try_acquire("acct-2", rate=1) == 0.0


def test_a_cooldown_only_ever_grows(redis_client: redis.Redis) -> None:
    pacer = Pacer(redis_client, prefix="pw")
    pacer.cooldown("acct-1", 5.0)
    left = pacer.cooldown("acct-1", 1.0)  # a shorter Retry-After does not shorten it
    assert 4.5 < left <= 5.0
    assert 4.5 < pacer.try_acquire("acct-1", rate=20) <= 5.0
    result = pacer.acquire("acct-1", rate=20, max_wait=1.0)
    assert not result.acquired and result.retry_after > 4.0


@pytest.mark.parametrize("rate", [3.0, 1000.0])
def test_first_request_after_a_cooldown_waits_for_its_end(
    redis_client: redis.Redis, rate: float
) -> None:
    pacer = Pacer(redis_client, prefix="pw")
    pacer.cooldown("acct-1", 0.3)
    start = time.monotonic()
    assert pacer.acquire("acct-1", rate=rate, max_wait=5).acquired
    assert time.monotonic() - start >= 0.3


def test_a_slot_opening_just_past_the_max_wait_is_given_up_at_once(
    redis_client: redis.Redis,
) -> None:
    """The account opens 1.2 s from now, the caller waits at most 1 s. The script answered
    how long until the slot comes within a lease's reach (0.7 s with a 0.5 s window), so the
    caller slept that, polled until 1 s and gave up with a retry_after of about 0.2 s (a
    review found it). Now it gives up at once, with the time until the slot opens."""
    pacer = Pacer(redis_client, prefix="pw", lease_seconds=0.5)
    pacer.cooldown("acct-1", 1.2)
    fresh = Pacer(redis_client, prefix="pw", lease_seconds=0.5)  # another process
    start = time.monotonic()
    result = fresh.acquire("acct-1", rate=20, max_wait=1.0)
    assert not result.acquired and time.monotonic() - start < 0.2
    assert 1.0 < result.retry_after <= 1.3


def test_a_cooldown_that_could_not_be_recorded_still_closes_this_process(
    redis_client: redis.Redis,
) -> None:
    """A 429's cooldown whose write failed (Redis out of reach) was only logged, and this
    process's next request leased a slot at once and met another 429 (a review found it)."""
    pacer = Pacer(redis_client, prefix="pw", lease_seconds=0.5)
    assert pacer.acquire("acct-1", rate=20, max_wait=1.0).acquired  # a lease of 10 slots

    def refused(*_: object, **__: object) -> int:
        raise redis.ConnectionError("Redis out of reach")

    pacer._cooldown = refused  # type: ignore[assignment]  (the one fault injected)
    with pytest.raises(redis.ConnectionError):
        pacer.cooldown("acct-1", 2.0)
    assert 1.5 < pacer.try_acquire("acct-1", rate=20) <= 2.0
