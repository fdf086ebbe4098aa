"""Shared tokens: no stampede across processes, compare-and-refresh, owner-checked lock."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.gateway import GatewayClient, GatewayResult, Outcome, tokens
from payment_worker.gateway.pacing import Pacer
from payment_worker.gateway.tokens import TOKEN_PAUSED, TokenManager
from payment_worker.settings import Settings
from tests.conftest import PwEnv
from tests.sim_fixtures import SimHandle, gateway_client, run_bursts

ACCT = "acct-s"
THREADS_PER_PROCESS = [13, 13, 12, 12]  # 50 threads in 4 processes


def tx(tx_id: str) -> PaymentRequest:
    return PaymentRequest(
        account_id=ACCT,
        transaction_id=tx_id,
        amount=1000,
        currency="IDR",
        beneficiary={"bank_code": "014", "account_number": "1234567890", "name": "Budi"},
    )


@pytest.fixture
def busy_account(
    pw_env: PwEnv, gateway_sim: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> Iterator[GatewayClient]:
    """An account that allows 50 concurrent requests, on both sides; a client in this process."""
    gateway_sim.configure(max_in_flight=100, rate=1000, latency_ms=20, latency_jitter_ms=10)
    monkeypatch.setenv("GATEWAY_RATE_OVERRIDES", json.dumps({ACCT: 1000}))
    c = gateway_client(Settings())
    yield c
    c.close()


def _specs() -> list[dict[str, Any]]:
    return [
        {"threads": n, "account_id": ACCT, "tx_prefix": f"p{i}"}
        for i, n in enumerate(THREADS_PER_PROCESS)
    ]


def _flat(results: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [r for proc in results for r in proc]


def test_expired_token_50_threads_4_processes_one_refresh(
    busy_account: GatewayClient, gateway_sim: SimHandle
) -> None:
    client = busy_account
    before: dict[str, Any] = {}

    def expire_then_snapshot() -> None:
        gateway_sim.configure(token_ttl=1.0)
        assert client.create_payment(ACCT, tx("prime"), tx("prime").idempotency_key).outcome == (
            Outcome.SUCCEEDED
        )
        while client.tokens.cached(ACCT) is not None:  # wait until the shared token expired
            time.sleep(0.05)
        time.sleep(0.1)  # and at the gateway too
        gateway_sim.configure(token_ttl=60)
        before.update(gateway_sim.ledger())

    _, results = run_bursts(_specs(), before_go=expire_then_snapshot)
    calls = _flat(results)
    after = gateway_sim.ledger()
    assert len(calls) == 50
    assert all(c["outcome"] == "succeeded" for c in calls), calls
    assert after["tokens_issued"] - before["tokens_issued"] == 1
    assert after["http_401"] - before["http_401"] == 0
    assert after["payments_sent"] - before["payments_sent"] == 50
    assert after["double_payments"] == []
    assert after["max_in_flight_seen"][ACCT] > 1  # the threads really were concurrent


def test_revoked_token_50_threads_see_401_and_cause_one_refresh(
    busy_account: GatewayClient, gateway_sim: SimHandle
) -> None:
    client = busy_account
    before: dict[str, Any] = {}

    def revoke_behind_their_back() -> None:
        assert client.create_payment(ACCT, tx("prime"), tx("prime").idempotency_key).outcome == (
            Outcome.SUCCEEDED
        )
        grant = {
            "grant_type": "client_credentials",
            "client_id": ACCT,
            "client_secret": "sim-secret",
        }
        httpx.post(f"{gateway_sim.url}/oauth/token", json=grant).raise_for_status()
        before.update(gateway_sim.ledger())

    _, results = run_bursts(_specs(), before_go=revoke_behind_their_back)
    calls = _flat(results)
    after = gateway_sim.ledger()
    # every thread got through, on its one retry at most
    assert len(calls) == 50 and all(c["outcome"] == "succeeded" for c in calls), calls
    assert after["tokens_issued"] - before["tokens_issued"] == 1  # one refresh, not 50
    assert 1 <= after["http_401"] - before["http_401"] <= 50
    assert after["payments_sent"] - before["payments_sent"] == 50


def _manager(redis_client: redis.Redis, url: str, lock_ttl: float, **kw: Any) -> TokenManager:
    http = httpx.Client(base_url=url, timeout=10)

    def fetch(account_id: str) -> httpx.Response:
        grant = {
            "grant_type": "client_credentials",
            "client_id": account_id,
            "client_secret": "sim-secret",
        }
        return http.post("/oauth/token", json=grant)

    return TokenManager(redis_client, fetch, lock_ttl=lock_ttl, **kw)


def test_a_refresher_whose_lock_expired_does_not_overwrite_the_newer_token(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    gateway_sim.configure(latency_ms=1500)
    slow = _manager(redis_client, gateway_sim.url, lock_ttl=1.0)
    other = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(slow=slow.get(ACCT)))
    t.start()
    time.sleep(1.2)  # slow's lock has expired, its token request is still running
    t2 = threading.Thread(target=lambda: got.update(other=other.get(ACCT)))
    t2.start()
    t.join()
    assert isinstance(got["slow"], str)
    assert slow.cached(ACCT) is None  # its late write was refused: it no longer held the lock
    t2.join()
    cached = other.cached(ACCT)
    assert cached is not None and cached.token == got["other"] != got["slow"]
    gateway_sim.configure(latency_ms=0)
    # the cached token is the newest one the gateway issued, so it works
    with httpx.Client(base_url=gateway_sim.url) as http:
        r = http.get(
            f"/v1/accounts/{ACCT}/payments/nope",
            headers={"Authorization": f"Bearer {cached.token}"},
        )
    assert r.status_code == 404


def test_a_crashed_refresher_delays_others_only_until_its_lock_expires(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    redis_client.set(mgr.lock_key(ACCT), "dead-owner", px=1200)
    start = time.monotonic()
    token = mgr.get(ACCT)
    elapsed = time.monotonic() - start
    assert isinstance(token, str)
    assert 1.0 <= elapsed < 3.0
    assert gateway_sim.ledger()["tokens_issued"] == 1


def test_a_due_token_is_used_while_another_process_refreshes(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    first = mgr.get(ACCT)
    assert isinstance(first, str)
    # time passes: the token's remaining lifetime is now inside its refresh lead
    redis_client.hset(mgr.token_key(ACCT), "lead_ms", 10**9)
    cached = mgr.cached(ACCT)
    assert cached is not None and cached.due
    redis_client.set(mgr.lock_key(ACCT), "someone-else", px=5000)
    start = time.monotonic()
    assert mgr.get(ACCT) == first  # no waiting for the other refresher
    assert time.monotonic() - start < 0.2
    redis_client.delete(mgr.lock_key(ACCT))
    second = mgr.get(ACCT)  # due and the lock free: this caller refreshes
    assert isinstance(second, str) and second != first
    assert gateway_sim.ledger()["tokens_issued"] == 2


def test_refresh_points_are_jittered_across_accounts(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    gateway_sim.configure(token_ttl=100, token_rate=100)
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0, refresh_fraction=0.2)
    leads = []
    for i in range(40):
        assert isinstance(mgr.get(f"acct-{i}"), str)
        cached = mgr.cached(f"acct-{i}")
        assert cached is not None and not cached.due
        leads.append(cached.lead_ms)
    # each token refreshes when 10-20 s of its 100 s are left, not all at the same moment
    assert all(10_000 <= lead <= 20_000 for lead in leads)
    assert max(leads) - min(leads) > 5_000
    assert len(set(leads)) > 35


def test_a_fresh_token_is_served_from_the_process_copy_until_due(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    first = mgr.get(ACCT)
    assert isinstance(first, str)
    # the shared copy disappears: a fresh process copy is still served, with no Redis read
    redis_client.delete(mgr.token_key(ACCT))
    assert mgr.get(ACCT) == first
    assert gateway_sim.ledger()["tokens_issued"] == 1
    # after a 401 the process copy is bypassed: Redis has none, so this caller refreshes
    second = mgr.get(ACCT, rejected=first)
    assert isinstance(second, str) and second != first
    assert gateway_sim.ledger()["tokens_issued"] == 2
    # and once a token comes due, the process copy is not trusted either
    redis_client.hset(mgr.token_key(ACCT), "lead_ms", 10**9)
    assert mgr.cached(ACCT) is not None
    assert mgr._local.get(ACCT) is None


class _Counting(redis.Redis):
    """A client that counts the commands it sends (a script call is one round trip)."""

    sent = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent += 1
        return super().execute_command(*args, **options)


def test_a_refresh_takes_two_round_trips_and_a_shared_token_one(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    counting = _Counting(connection_pool=redis_client.connection_pool)
    mgr = _manager(counting, gateway_sim.url, lock_ttl=5.0)
    # first sight of the account: read-and-lock in one script, then store-and-release in one
    token = mgr.get(ACCT)
    assert isinstance(token, str) and counting.sent == 2
    assert redis_client.get(mgr.lock_key(ACCT)) is None  # released by the store
    # another process: one script reads the shared token, then its own copy costs nothing
    other = _manager(counting, gateway_sim.url, lock_ttl=5.0)
    counting.sent = 0
    assert other.get(ACCT) == token and counting.sent == 1
    assert other.get(ACCT) == token and counting.sent == 1
    assert gateway_sim.ledger()["tokens_issued"] == 1


def test_a_failed_refresh_releases_the_lock_at_once(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    gateway_sim.script(ACCT, {"fault": "503", "endpoint": "token"})
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=30.0)
    failed = mgr.get(ACCT)
    assert not isinstance(failed, str)
    assert redis_client.get(mgr.lock_key(ACCT)) is None  # not left for its 30 s TTL
    # another process refreshes at once (this one pauses its own requests: below)
    other = _manager(redis_client, gateway_sim.url, lock_ttl=30.0)
    assert isinstance(other.get(ACCT), str)


def test_a_failed_token_request_pauses_the_processs_requests_of_that_account(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    """No token: the account's next token requests in this process wait 1 s, then 2 s (a
    failure in a row), answered "not sent" meanwhile without a request; a token another
    process stored meanwhile is used at once, and ends the pause."""
    gateway_sim.script(ACCT, *[{"fault": "503", "endpoint": "token"}] * 2)
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    first = mgr.get(ACCT)
    assert isinstance(first, GatewayResult) and first.http_status == 503 and not first.sent
    paused = mgr.get(ACCT)
    assert isinstance(paused, GatewayResult) and paused.reason == TOKEN_PAUSED
    assert not paused.sent and paused.outcome is Outcome.RETRY
    assert paused.retry_after is not None and 0.5 < paused.retry_after <= 1.0
    assert paused.error is not None and "HTTP 503" in paused.error  # the failure it follows
    assert gateway_sim.statuses(ACCT, "token") == [503]  # nothing asked during the pause
    time.sleep(paused.retry_after + 0.02)
    second = mgr.get(ACCT)  # asked again: refused again, so the next pause is 2 s
    assert isinstance(second, GatewayResult) and second.http_status == 503
    again = mgr.get(ACCT)
    assert isinstance(again, GatewayResult) and again.retry_after is not None
    assert 1.5 < again.retry_after <= 2.0
    assert gateway_sim.statuses(ACCT, "token") == [503, 503]
    # another process gets a token (the faults are spent): this one reads it, pause or not
    token = _manager(redis_client, gateway_sim.url, lock_ttl=5.0).get(ACCT)
    assert isinstance(token, str)
    assert mgr.get(ACCT) == token
    assert gateway_sim.statuses(ACCT, "token") == [503, 503, 200]


def test_a_token_refusals_retry_after_lengthens_the_pause(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    gateway_sim.script(ACCT, {"fault": "429", "endpoint": "token", "retry_after": 3})
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    refused = mgr.get(ACCT)
    assert isinstance(refused, GatewayResult) and refused.http_status == 429
    paused = mgr.get(ACCT)
    assert isinstance(paused, GatewayResult) and paused.reason == TOKEN_PAUSED
    assert paused.retry_after is not None and 2.5 < paused.retry_after <= 3.0


def test_a_token_refusals_long_retry_after_is_honoured_past_the_backoffs_cap(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    """The protocol: a token 429 means wait at least Retry-After. The pause's backoff stops at
    30 s, but a Retry-After of 45 s is honoured (before, the pause was cut to 30 s and the
    next token request met another 429); one past RETRY_AFTER_MAX_SECONDS is cut to it."""
    gateway_sim.script(ACCT, {"fault": "429", "endpoint": "token", "retry_after": 45})
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0, retry_after_max=40.0)
    refused = mgr.get(ACCT)
    assert isinstance(refused, GatewayResult) and refused.http_status == 429
    paused = mgr.get(ACCT)
    assert isinstance(paused, GatewayResult) and paused.reason == TOKEN_PAUSED
    assert paused.retry_after is not None and 39.5 < paused.retry_after <= 40.0
    gateway_sim.script(ACCT, {"fault": "429", "endpoint": "token", "retry_after": 35})
    mgr2 = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    assert isinstance(mgr2.get(ACCT), GatewayResult)
    paused = mgr2.get(ACCT)
    assert isinstance(paused, GatewayResult) and paused.retry_after is not None
    assert 34.5 < paused.retry_after <= 35.0


def _pause_ended_by_the_stored_token(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> tuple[TokenManager, str]:
    """A token had, then due for its refresh ahead of expiry, which answered 503: paused;
    the token still in Redis (and still valid) is used at once, ending the pause early. The
    manager and that token. (A token refused with a 401 whose refresh fails leaves Redis
    with that refresh: ``test_a_refused_token_whose_refresh_failed_is_never_sent_again``.)"""
    gateway_sim.configure(token_ttl=4.0)
    # refreshed 1.8 to 3.6 s ahead of its expiry: due after 2.2 s, valid 1.7 s more
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0, refresh_fraction=0.9)
    first = mgr.get(ACCT)
    assert isinstance(first, str)
    time.sleep(2.2)
    gateway_sim.script(ACCT, {"fault": "503", "endpoint": "token"})
    failed = mgr.get(ACCT)  # due: the refresh meets the 503
    assert isinstance(failed, GatewayResult) and failed.http_status == 503
    assert mgr.get(ACCT) == first  # still in Redis: used, the pause ended early
    return mgr, first


def test_a_refused_token_whose_refresh_failed_is_never_sent_again(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    """A 401 on the shared token, and its refresh fails (a 503, or a token issued whose
    answer was lost): the refused token leaves Redis with it. Before, every process sent it
    again, during the pause (it ended the pause) and after it, a 401 each."""
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    first = mgr.get(ACCT)
    assert isinstance(first, str)
    gateway_sim.script(ACCT, {"fault": "503", "endpoint": "token"})
    failed = mgr.get(ACCT, rejected=first)  # a 401 on it: the refresh meets the 503
    assert isinstance(failed, GatewayResult) and failed.http_status == 503
    assert mgr.cached(ACCT) is None
    paused = mgr.get(ACCT)  # paused here, and the refused token does not end the pause
    assert isinstance(paused, GatewayResult) and paused.reason == TOKEN_PAUSED
    # another process finds no token to send: it refreshes, and this one takes that token
    fresh = _manager(redis_client, gateway_sim.url, lock_ttl=5.0).get(ACCT)
    assert isinstance(fresh, str) and fresh != first
    assert mgr.get(ACCT) == fresh
    assert gateway_sim.statuses(ACCT, "token") == [200, 503, 200]


def test_a_stored_token_refused_after_it_ended_a_pause_brings_the_pause_back(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    """A token request failed (it may have been issued a token, revoking the one in Redis):
    the pause is ended early by the token still in Redis, and when the gateway refuses that
    very token the pause comes back, with no token request. Before, the pause was gone: each
    item cost a 401 and a token request while the endpoint failed (a review found it)."""
    mgr, first = _pause_ended_by_the_stored_token(redis_client, gateway_sim)
    asked = len(gateway_sim.statuses(ACCT, "token"))
    again = mgr.get(ACCT, rejected=first)  # refused: the pause comes back, longer
    assert isinstance(again, GatewayResult) and again.reason == TOKEN_PAUSED
    assert again.retry_after is not None and 1.5 < again.retry_after <= 2.0
    assert len(gateway_sim.statuses(ACCT, "token")) == asked  # no token request
    # nor does the next item send the refused token again: the process's copy went with
    # the 401, and the same token read from Redis does not end this pause (before, each
    # item sent it and met a 401 until the endpoint came back: a review found it)
    for _ in range(3):
        item = mgr.get(ACCT)
        assert isinstance(item, GatewayResult) and item.reason == TOKEN_PAUSED
    assert len(gateway_sim.statuses(ACCT, "token")) == asked
    # once the pause is over, a refresh goes out and ends it for good
    time.sleep(again.retry_after + 0.02)
    fresh = mgr.get(ACCT, rejected=first)
    assert isinstance(fresh, str) and fresh != first
    assert mgr.get(ACCT) == fresh


def test_a_token_stored_by_another_process_after_the_pause_is_used_not_paused_for(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    mgr, first = _pause_ended_by_the_stored_token(redis_client, gateway_sim)
    other = _manager(redis_client, gateway_sim.url, lock_ttl=5.0).get(ACCT, rejected=first)
    assert isinstance(other, str) and other != first  # another process refreshed
    assert mgr.get(ACCT, rejected=first) == other  # used at once, no pause


def test_a_429s_cooldown_holds_back_every_processs_token_request(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    """The protocol: after a 429, wait at least Retry-After. The cooldown a 429 records is
    the account's, in Redis; before, only the process that met a token 429 paused its token
    requests, and each other process asked again and met another 429 (a review found it)."""
    Pacer(redis_client).cooldown(ACCT, 2.0)  # as the client records a token 429's
    other = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    held = other.get(ACCT)
    assert isinstance(held, GatewayResult) and held.reason == "paced" and not held.sent
    assert held.retry_after is not None and 1.5 < held.retry_after <= 2.0
    assert redis_client.get(other.lock_key(ACCT)) is None  # no refresh lock taken either
    assert gateway_sim.statuses(ACCT, "token") == []
    time.sleep(held.retry_after + 0.02)
    token = other.get(ACCT)
    assert isinstance(token, str)
    assert gateway_sim.statuses(ACCT, "token") == [200]


def test_a_valid_token_is_still_used_while_the_account_cools_down(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    """A cooldown holds back token requests only: a token still valid (if due) is used, and
    the pacer answers for the request itself."""
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    first = mgr.get(ACCT)
    assert isinstance(first, str)
    redis_client.hset(mgr.token_key(ACCT), "lead_ms", 10**9)  # due now, still valid
    Pacer(redis_client).cooldown(ACCT, 2.0)
    assert _manager(redis_client, gateway_sim.url, lock_ttl=5.0).get(ACCT) == first
    assert gateway_sim.statuses(ACCT, "token") == [200]


def test_the_pause_backoff_starts_afresh_after_a_quiet_spell(
    redis_client: redis.Redis, gateway_sim: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pause doubles for failures in a row only: one long after the last pause ended
    starts from the first step again (before, unrelated blips hours apart added up to 30 s
    pauses: a review found it)."""
    monkeypatch.setattr(tokens, "_PAUSE_FIRST", 0.2)
    monkeypatch.setattr(tokens, "_PAUSE_MAX", 0.5)
    gateway_sim.script(ACCT, *[{"fault": "503", "endpoint": "token"}] * 3)
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)

    def pause_after_a_failure(step: float) -> float:
        """The pause left after a failure, checked to be ``step`` less the time the calls
        took (measured, so a stalled thread under a loaded run does not fail it)."""
        started = time.monotonic()
        failed = mgr.get(ACCT)
        assert isinstance(failed, GatewayResult) and failed.http_status == 503
        paused = mgr.get(ACCT)
        assert isinstance(paused, GatewayResult) and paused.reason == TOKEN_PAUSED
        assert paused.retry_after is not None
        took = time.monotonic() - started
        assert step - took - 0.01 <= paused.retry_after <= step
        # the step itself told apart from the one before (0.2 apart) unless the calls stalled
        assert took >= 0.15 or paused.retry_after > step - 0.16, (paused.retry_after, took)
        return paused.retry_after

    first = pause_after_a_failure(0.2)
    time.sleep(first + 0.02)
    second = pause_after_a_failure(0.4)  # in a row: doubled
    time.sleep(second + 0.5 + 0.1)  # ended longer ago than the backoff's cap
    pause_after_a_failure(0.2)  # afresh


def test_a_retried_claim_that_holds_the_lock_refreshes_even_while_the_account_cools_down(
    redis_client: redis.Redis, gateway_sim: SimHandle
) -> None:
    """A claim took the refresh lock and its reply was lost; a 429's cooldown was recorded
    before the retry. The retry still answers "refresh" (the lock is its own): answered
    "cooling", it left the lock to an owner nobody knew until its TTL (a review found it)."""
    mgr = _manager(redis_client, gateway_sim.url, lock_ttl=5.0)
    redis_client.set(mgr.lock_key(ACCT), "owner-1", px=5000)  # the first run's, reply lost
    Pacer(redis_client).cooldown(ACCT, 2.0)
    verdict, _, cooling = mgr._claim_token(ACCT, "owner-1", None)
    assert (verdict, cooling) == ("refresh", 0)
    # anyone else meets the cooldown, lock or no lock
    assert mgr._claim_token(ACCT, "owner-2", None)[0] == "cooling"
