"""GatewayClient against the real simulator and real Redis: every outcome, end to end."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from prometheus_client import REGISTRY
from pydantic import SecretStr

from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.gateway import GatewayClient, Outcome
from payment_worker.gateway.tokens import TOKEN_PAUSED
from payment_worker.settings import Settings
from tests.conftest import PwEnv, wait_until
from tests.sim_fixtures import SimHandle, gateway_client

ACCT = "acct-1"


def tx(
    tx_id: str = "tx-1", number: str = "1234567890", amount: int = 150000, account: str = ACCT
) -> PaymentRequest:
    return PaymentRequest(
        account_id=account,
        transaction_id=tx_id,
        amount=amount,
        currency="IDR",
        beneficiary={"bank_code": "014", "account_number": number, "name": "Budi"},
    )


def make_settings(**overrides: Any) -> Settings:
    # pw_env and gateway_sim have set REDIS_URL / GATEWAY_URL in the environment
    return Settings().model_copy(update=overrides)


@pytest.fixture
def client(pw_env: PwEnv, gateway_sim: SimHandle) -> Iterator[GatewayClient]:
    c = gateway_client(make_settings(gateway_read_timeout=0.5))
    yield c
    c.close()


def create(client: GatewayClient, p: PaymentRequest) -> Any:
    return client.create_payment(p.account_id, p, p.idempotency_key)


def test_201_succeeded_then_replay(client: GatewayClient, gateway_sim: SimHandle) -> None:
    first = create(client, tx())
    assert (first.outcome, first.http_status, first.replayed) == (Outcome.SUCCEEDED, 201, False)
    assert first.payment_id
    # a second PaymentRequest of the same transaction derives the same key: a replay
    again = create(client, tx())
    assert (again.outcome, again.http_status, again.replayed) == (Outcome.SUCCEEDED, 200, True)
    assert again.payment_id == first.payment_id
    assert gateway_sim.ledger()["sends"] == {f"{ACCT}/tx-1": 1}


def test_the_key_sent_is_the_one_given(client: GatewayClient) -> None:
    p = tx()
    assert create(client, p).outcome is Outcome.SUCCEEDED
    found = client.lookup_payment(ACCT, p.idempotency_key)
    assert (found.outcome, found.http_status) == (Outcome.SUCCEEDED, 200)


def test_402_declined(client: GatewayClient) -> None:
    r = create(client, tx(number="REJECT-77"))
    assert (r.outcome, r.reason, r.error_class) == (
        Outcome.DECLINED,
        "beneficiary_blocked",
        "declined:beneficiary_blocked",
    )
    looked = client.lookup_payment(ACCT, tx(number="REJECT-77").idempotency_key)
    assert (looked.outcome, looked.reason) == (Outcome.DECLINED, "beneficiary_blocked")


def test_422_conflict_on_same_key_other_body(client: GatewayClient) -> None:
    p = tx(amount=100)
    assert create(client, p).outcome is Outcome.SUCCEEDED
    r = client.create_payment(ACCT, tx(amount=999), p.idempotency_key)
    assert (r.outcome, r.http_status, r.reason) == (
        Outcome.CONFLICT,
        422,
        "idempotency_key_reused",
    )


def test_409_maybe_sent_while_the_same_key_is_in_flight(
    pw_env: PwEnv, gateway_sim: SimHandle
) -> None:
    client = gateway_client(make_settings(gateway_read_timeout=5.0))
    assert client.lookup_payment(ACCT, "pw1-warm").outcome is Outcome.NOT_FOUND  # token ready
    # a wide window: on a loaded machine the first request must still be in flight (1.5 s at
    # the gateway) when the second arrives, 0.5 s after the first was sent
    gateway_sim.configure(max_in_flight=5, latency_ms=1500)
    p = tx()
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(create(client, p)))
    t.start()
    time.sleep(0.5)
    second = create(client, p)
    t.join()
    client.close()
    assert results[0].outcome is Outcome.SUCCEEDED
    assert (second.outcome, second.http_status) == (Outcome.UNKNOWN, 409)
    assert gateway_sim.ledger()["payments_sent"] == 1


def test_429_retry_records_a_cooldown_for_every_process(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    gateway_sim.script(ACCT, {"fault": "429", "retry_after": 2})
    r = create(client, tx())
    assert (r.outcome, r.http_status, r.retry_after) == (Outcome.RETRY, 429, 2.0)
    # what any process sees now: the first slot one interval after the cooldown ends
    wait = client.pacer.try_acquire(ACCT, 20.0, ahead=0.0)
    assert 1.8 <= wait <= 2.0 + 1 / 20


def test_a_refused_token_request_sends_nothing_and_says_why(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    """The token answer as the client reads it (status, headers, body as text and JSON):
    a 429 carries its Retry-After, a 503 its error code; no payment leaves either time."""
    gateway_sim.script(ACCT, {"fault": "429", "retry_after": 3, "endpoint": "token"})
    limited = create(client, tx())
    assert (limited.outcome, limited.http_status, limited.sent) == (Outcome.RETRY, 429, False)
    assert limited.retry_after == 3.0
    assert limited.reason.startswith("token_") and "HTTP 429" in (limited.error or "")
    # the account's token requests now wait out the Retry-After: nothing is asked meanwhile
    paused = create(client, tx())
    assert (paused.outcome, paused.reason, paused.sent) == (Outcome.RETRY, TOKEN_PAUSED, False)
    assert paused.retry_after is not None and 2.5 < paused.retry_after <= 3.0
    assert gateway_sim.statuses(ACCT, "token") == [429]
    time.sleep(paused.retry_after + 0.05)
    gateway_sim.script(ACCT, {"fault": "503", "endpoint": "token"})
    down = create(client, tx())
    assert (down.outcome, down.http_status, down.sent) == (Outcome.RETRY, 503, False)
    assert down.reason == "token_service_unavailable", down.reason
    assert gateway_sim.ledger()["payments_sent"] == 0
    # and once its pause is over (2 s: the second failure in a row), a token and a payment
    time.sleep(2.05)
    assert create(client, tx()).outcome is Outcome.SUCCEEDED


@pytest.mark.parametrize(
    ("fault", "outcome", "status"),
    [
        ("503", Outcome.RETRY, 503),
        ("500", Outcome.UNKNOWN, 500),
        ("502", Outcome.UNKNOWN, 502),
        ("504", Outcome.UNKNOWN, 504),
    ],
)
def test_5xx(
    client: GatewayClient, gateway_sim: SimHandle, fault: str, outcome: Outcome, status: int
) -> None:
    gateway_sim.script(ACCT, {"fault": fault, "applied": True, "endpoint": "create"})
    r = create(client, tx())
    assert (r.outcome, r.http_status, r.error_class) == (outcome, status, f"http_{status}")
    looked = client.lookup_payment(ACCT, tx().idempotency_key)
    # 503 applied nothing; the others did here (applied: true), which only a lookup tells
    expected = Outcome.NOT_FOUND if fault == "503" else Outcome.SUCCEEDED
    assert looked.outcome is expected


def test_lost_response_is_unknown_and_a_lookup_finds_the_payment(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    gateway_sim.configure(p_lost=1.0)
    r = create(client, tx())
    assert (r.outcome, r.http_status, r.error_class) == (Outcome.UNKNOWN, None, "reset")
    gateway_sim.configure(p_lost=0.0)
    looked = client.lookup_payment(ACCT, tx().idempotency_key)
    assert looked.outcome is Outcome.SUCCEEDED and looked.payment_id
    again = create(client, tx())  # resending under the same key is a replay, not a payment
    assert (again.outcome, again.replayed, again.payment_id) == (
        Outcome.SUCCEEDED,
        True,
        looked.payment_id,
    )
    assert gateway_sim.ledger()["sends"] == {f"{ACCT}/tx-1": 1}


def test_slow_response_is_unknown_and_a_lookup_finds_the_payment(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    gateway_sim.configure(p_slow=1.0, slow_seconds=2.0)
    start = time.monotonic()
    r = create(client, tx())
    assert time.monotonic() - start < 1.5  # the read timeout (0.5 s) ended the wait
    assert (r.outcome, r.http_status, r.error_class) == (Outcome.UNKNOWN, None, "timeout")
    gateway_sim.configure(p_slow=0.0)
    # the gateway is still answering it: the account's one request in flight, so a lookup
    # now is refused (429), not answered, and tells nothing
    busy = client.lookup_payment(ACCT, tx().idempotency_key)
    assert (busy.outcome, busy.http_status) == (Outcome.RETRY, 429)
    assert gateway_sim.ledger()["http_429_by_cause"]["concurrency_late"] == 1
    # refused until the late answer is written, 2 s after the create arrived; then found
    looked = busy
    while looked.http_status == 429 and time.monotonic() < start + 8:
        time.sleep(0.1)
        looked = client.lookup_payment(ACCT, tx().idempotency_key)
    assert time.monotonic() - start >= 1.9
    assert looked.outcome is Outcome.SUCCEEDED and looked.payment_id
    assert gateway_sim.ledger()["sends"] == {f"{ACCT}/tx-1": 1}


def test_connection_refused_is_retry(pw_env: PwEnv) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    c = gateway_client(make_settings(gateway_url=f"http://127.0.0.1:{port}"))
    r = create(c, tx())
    c.close()
    # the token request could not connect: nothing was sent
    assert r.outcome is Outcome.RETRY and r.http_status is None
    assert r.error_class == "token_connect_error"


def test_lookup_not_found_and_in_flight(pw_env: PwEnv, gateway_sim: SimHandle) -> None:
    # a read timeout longer than the create's latency: the create is answered, not abandoned
    client = gateway_client(make_settings(gateway_read_timeout=10.0))
    try:
        assert client.lookup_payment(ACCT, "pw1-never").outcome is Outcome.NOT_FOUND
        gateway_sim.configure(max_in_flight=5, latency_ms=2000)
        created: list[Any] = []
        t = threading.Thread(target=lambda: created.append(create(client, tx())))
        t.start()
        # the simulator counts a create as it arrives, when it stores its key as in flight
        # and draws its latency
        wait_until(
            lambda: gateway_sim.ledger()["requests"].get("create", 0) == 1,
            10,
            "the create to arrive",
        )
        gateway_sim.configure(latency_ms=0)
        r = client.lookup_payment(ACCT, tx().idempotency_key)
        t.join(10)
    finally:
        client.close()
    assert (r.outcome, r.http_status) == (Outcome.IN_FLIGHT, 409)
    assert [c.outcome for c in created] == [Outcome.SUCCEEDED]


def test_401_refreshes_once_and_retries(client: GatewayClient, gateway_sim: SimHandle) -> None:
    assert create(client, tx("tx-0")).outcome is Outcome.SUCCEEDED
    # someone else takes a token for the account: ours is revoked at the gateway
    grant = {"grant_type": "client_credentials", "client_id": ACCT, "client_secret": "sim-secret"}
    httpx.post(f"{gateway_sim.url}/oauth/token", json=grant).raise_for_status()
    r = create(client, tx("tx-1"))
    assert r.outcome is Outcome.SUCCEEDED
    ledger = gateway_sim.ledger()
    assert ledger["http_401"] == 1
    assert ledger["tokens_issued"] == 3  # ours, the intruder's, our one refresh


def test_a_token_issued_whose_answer_is_lost_is_a_retry_then_one_refresh(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    """The gateway issues a token (revoking every earlier one) and its answer never arrives:
    the connection is reset. Nothing is paid meanwhile, and the next try takes one token."""
    assert create(client, tx("tx-0")).outcome is Outcome.SUCCEEDED
    grant = {"grant_type": "client_credentials", "client_id": ACCT, "client_secret": "sim-secret"}
    httpx.post(f"{gateway_sim.url}/oauth/token", json=grant).raise_for_status()
    gateway_sim.script(ACCT, {"fault": "lost", "endpoint": "token"})
    lost = create(client, tx("tx-1"))  # a 401, then a refresh whose answer is lost
    assert lost.outcome is Outcome.RETRY and lost.reason.startswith("token_"), lost
    assert gateway_sim.statuses(ACCT, "token")[-1] == "lost"
    assert gateway_sim.ledger()["faults"] == {"lost": 1}
    assert gateway_sim.ledger()["payments_sent"] == 1
    wait_until(lambda: create(client, tx("tx-1")).outcome is Outcome.SUCCEEDED, 10.0, "tx-1 paid")
    ledger = gateway_sim.ledger()
    # ours, the intruder's, the lost one, the one that paid tx-1: no token per try
    assert (ledger["tokens_issued"], ledger["payments_sent"]) == (4, 2), ledger
    # one 401: the refused token left the shared hash with the failed refresh (it was sent
    # again after the lost answer and after the pause, a 401 each, before)
    assert ledger["http_401"] == 1, gateway_sim.requests(ACCT)


def test_401_twice_is_retry(client: GatewayClient, gateway_sim: SimHandle) -> None:
    # a token dies a microsecond after it is issued: before any request can carry it (a
    # millisecond was not enough on a fast host, where the create arrived within it)
    gateway_sim.configure(token_ttl=1e-6, latency_ms=5)
    r = create(client, tx())
    assert (r.outcome, r.http_status, r.reason) == (Outcome.RETRY, 401, "invalid_token")
    ledger = gateway_sim.ledger()
    assert (ledger["requests"]["create"], ledger["payments_sent"]) == (2, 0)


def test_wrong_secret_is_retry_and_sends_nothing(pw_env: PwEnv, gateway_sim: SimHandle) -> None:
    c = gateway_client(make_settings(gateway_client_secret=SecretStr("wrong")))
    r = create(c, tx())
    c.close()
    assert (r.outcome, r.http_status, r.reason) == (Outcome.RETRY, 401, "token_invalid_client")
    assert gateway_sim.ledger()["requests"].get("create", 0) == 0


def test_pacing_keeps_an_account_under_its_quota(pw_env: PwEnv, gateway_sim: SimHandle) -> None:
    c = gateway_client(make_settings(gateway_rate_overrides={ACCT: 5.0}))
    # warm up: tokens and connections, so that only pacing is timed
    assert create(c, tx("warm-1")).outcome is create(c, tx("warm-2", account="acct-2")).outcome
    time.sleep(0.3)
    start = time.monotonic()
    results = [create(c, tx(f"tx-{i}")) for i in range(8)]
    elapsed = time.monotonic() - start
    start = time.monotonic()
    other = [create(c, tx(f"tx-{i}", account="acct-2")) for i in range(8)]
    elapsed_other = time.monotonic() - start
    c.close()
    assert all(r.outcome is Outcome.SUCCEEDED for r in results + other)
    assert elapsed >= 7 / 5 - 0.05  # 8 requests at 5/s: 7 intervals of 0.2 s
    assert elapsed_other < 1.0  # the default 20/s: 7 intervals of 0.05 s
    assert gateway_sim.ledger()["http_429"] == 0


def test_pacing_wait_longer_than_allowed_returns_retry_without_sending(
    pw_env: PwEnv, gateway_sim: SimHandle
) -> None:
    c = gateway_client(make_settings(gateway_pacing_max_wait=0.5))
    c.pacer.cooldown(ACCT, 5.0)
    answers = _sample("payment_worker_gateway_requests_total", endpoint="create", outcome="retry")
    held = _sample("payment_worker_gateway_not_sent_total", endpoint="create", reason="paced")
    start = time.monotonic()
    r = create(c, tx())
    c.close()
    assert time.monotonic() - start < 0.5  # gave up at once instead of sleeping 5 s
    assert (r.outcome, r.reason) == (Outcome.RETRY, "paced")
    assert r.retry_after is not None and 4.0 < r.retry_after <= 5.0
    assert gateway_sim.ledger()["requests"].get("create", 0) == 0
    # counted as held back, not as a gateway answer (whose error ratio pages on-call)
    assert _sample("payment_worker_gateway_not_sent_total", endpoint="create", reason="paced") == (
        held + 1
    )
    assert (
        _sample("payment_worker_gateway_requests_total", endpoint="create", outcome="retry")
        == answers
    )


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_programming_errors_raise(client: GatewayClient) -> None:
    with pytest.raises(ValueError, match="belongs to account"):
        client.create_payment("acct-2", tx(), tx().idempotency_key)
    with pytest.raises(ValueError, match="Idempotency-Key"):
        client.create_payment(ACCT, tx(), "")
    with pytest.raises(ValueError, match="Idempotency-Key"):
        client.lookup_payment(ACCT, "x" * 256)


def test_default_redis_and_keys_carry_the_prefix_and_hash_tag(
    client: GatewayClient, redis_client: redis.Redis
) -> None:
    assert create(client, tx()).outcome is Outcome.SUCCEEDED
    keys = sorted(k.decode() for k in redis_client.keys("*"))
    assert keys == [f"pw:pace:{{{ACCT}}}", f"pw:token:{{{ACCT}}}"]


def test_tokens_are_refreshed_ahead_of_expiry_without_401(
    pw_env: PwEnv, gateway_sim: SimHandle
) -> None:
    gateway_sim.configure(token_ttl=2.0)
    c = gateway_client(make_settings(gateway_token_refresh_fraction=0.3))
    deadline = time.monotonic() + 5.2
    i = 0
    while time.monotonic() < deadline:
        assert create(c, tx(f"tx-{i}")).outcome is Outcome.SUCCEEDED
        i += 1
        time.sleep(0.05)
    c.close()
    ledger = gateway_sim.ledger()
    assert ledger["http_401"] == 0
    # 5.2 s of 2 s tokens refreshed 15-30 % early: 3 or 4 tokens, never one per request
    assert 3 <= ledger["tokens_issued"] <= 4


def test_a_token_held_back_by_a_cooldown_is_waited_for_then_asked_once(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    """No token yet and the account cooling down (another process met a 429): no token
    request before the cooldown ends (the protocol), then one, and the payment goes."""
    p = tx("c1")
    cooled_from = gateway_sim.now()  # (read first: under load the read itself takes a while)
    client.pacer.cooldown(p.account_id, 0.5)
    assert create(client, p).outcome is Outcome.SUCCEEDED
    asked = [t for t, e, _ in gateway_sim.requests(p.account_id) if e == "token"]
    assert gateway_sim.statuses(p.account_id, "token") == [200]
    assert asked[0] - cooled_from >= 0.45  # (the old client asked at once)


def test_guard_runs_after_the_pacing_wait_and_stops_the_send(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    from payment_worker.errors import LockLost

    p = tx("g1")
    client.pacer.cooldown(p.account_id, 0.5)  # a 429 cooldown: the call first waits
    calls: list[float] = []
    start = time.monotonic()

    def lost() -> None:
        calls.append(time.monotonic() - start)
        raise LockLost("lock expired while waiting for the account's slot")

    with pytest.raises(LockLost):
        client.create_payment(p.account_id, p, p.idempotency_key, guard=lost)
    assert len(calls) == 1 and calls[0] >= 0.45  # checked after the wait, not before it
    ledger = gateway_sim.ledger()
    assert ledger["payments_sent"] == 0 and ledger["requests"].get("create", 0) == 0


def test_threads_share_idle_connections_and_never_one_in_use(
    client: GatewayClient, gateway_sim: SimHandle
) -> None:
    """A request takes an idle keep-alive connection from the shared stack or opens one:
    requests at once each get their own, and new threads after them (Celery starts one for
    each task that finds none idle) open none."""
    gateway_sim.configure(latency_ms=200)
    go = threading.Barrier(6)
    results: list[Any] = []

    def at_once(n: int) -> None:
        go.wait()
        results.append(create(client, tx(f"tx-at-once-{n}", account=f"acct-share-{n}")))

    threads = [threading.Thread(target=at_once, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.outcome for r in results] == [Outcome.SUCCEEDED] * 6
    made = len(client._connections)
    # one each while in flight together (the token fetches may have taken some too)
    assert 6 <= made <= 12
    gateway_sim.configure(latency_ms=0)
    for n in range(20):  # one after another, each on a new thread
        t = threading.Thread(
            target=lambda n=n: results.append(create(client, tx(f"tx-later-{n}", account=ACCT)))
        )
        t.start()
        t.join()
    assert all(r.outcome is Outcome.SUCCEEDED for r in results)
    assert len(client._connections) == made
