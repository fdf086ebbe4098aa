"""Simulator conformance: one test per row of docs/gateway-protocol.md, over real HTTP."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import wait_until
from tests.sim_fixtures import ROOT, SimHandle, run_simulator

SECRET = "sim-secret"


def body(tx: str = "tx-1", number: str = "1234567890", amount: int = 150000) -> dict[str, Any]:
    return {
        "transaction_id": tx,
        "amount": amount,
        "currency": "IDR",
        "beneficiary": {"bank_code": "014", "account_number": number, "name": "Budi"},
        "description": "payout",
    }


class Api:
    """Raw protocol calls against the simulator."""

    def __init__(self, sim: SimHandle, read_timeout: float = 10.0) -> None:
        self.sim = sim
        self.http = httpx.Client(base_url=sim.url, timeout=httpx.Timeout(10.0, read=read_timeout))

    def token_response(self, account: str, secret: str = SECRET) -> httpx.Response:
        grant = {"grant_type": "client_credentials", "client_id": account, "client_secret": secret}
        return self.http.post("/oauth/token", json=grant)

    def token(self, account: str = "acct-1") -> str:
        tok: str = self.token_response(account).raise_for_status().json()["access_token"]
        return tok

    def create(
        self, token: str, key: str | None, data: dict[str, Any], account: str = "acct-1"
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        if key is not None:
            headers["Idempotency-Key"] = key
        return self.http.post(f"/v1/accounts/{account}/payments", json=data, headers=headers)

    def lookup(self, token: str, key: str, account: str = "acct-1") -> httpx.Response:
        return self.http.get(
            f"/v1/accounts/{account}/payments/{key}", headers={"Authorization": f"Bearer {token}"}
        )


@pytest.fixture
def api(gateway_sim: SimHandle) -> Iterator[Api]:
    a = Api(gateway_sim)
    yield a
    a.http.close()


# --- authentication ---------------------------------------------------------------------
def test_token_200_issues_a_bearer_token(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(token_ttl=300)
    r = api.token_response("acct-1")
    assert r.status_code == 200
    data = r.json()
    assert data["token_type"] == "Bearer" and data["expires_in"] == 300
    assert isinstance(data["access_token"], str) and len(data["access_token"]) >= 16
    assert gateway_sim.ledger()["tokens_issued_per_account"] == {"acct-1": 1}


def test_token_401_invalid_client_on_wrong_secret(api: Api, gateway_sim: SimHandle) -> None:
    r = api.token_response("acct-1", secret="wrong")
    assert (r.status_code, r.json()) == (401, {"error": "invalid_client"})
    assert gateway_sim.ledger()["tokens_issued"] == 0


def test_token_429_when_token_requests_exceed_the_quota(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(token_rate=1)
    assert api.token_response("acct-1").status_code == 200
    r = api.token_response("acct-1")
    assert (r.status_code, r.json()) == (429, {"error": "rate_limited"})
    assert int(r.headers["Retry-After"]) >= 1
    assert api.token_response("acct-2").status_code == 200  # the quota is per account
    assert gateway_sim.ledger()["http_429_by_cause"]["token"] == 1


def test_issuing_a_token_revokes_every_earlier_token(api: Api, gateway_sim: SimHandle) -> None:
    first, second = api.token(), api.token()
    r = api.create(first, "k-1", body())
    assert (r.status_code, r.json()) == (401, {"error": "invalid_token"})
    assert api.create(second, "k-1", body()).status_code == 201
    assert gateway_sim.ledger()["http_401"] == 1


def test_an_expired_token_gets_401(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(token_ttl=1.5)
    granted = api.token_response("acct-1")
    issued = time.monotonic()  # the simulator's expiry clock started before this
    assert granted.json()["expires_in"] == 1.5
    tok = granted.json()["access_token"]
    assert api.create(tok, "k-0", body("tx-0")).status_code == 201
    _sleep_until(issued + 1.5 + 0.2)
    r = api.create(tok, "k-1", body())
    assert (r.status_code, r.json()) == (401, {"error": "invalid_token"})


def test_a_token_of_another_account_gets_401(api: Api) -> None:
    other = api.token("acct-2")
    assert api.create(other, "k-1", body(), account="acct-1").status_code == 401


# --- create: one test per row -----------------------------------------------------------
def test_create_201_sends_money_once(api: Api, gateway_sim: SimHandle) -> None:
    r = api.create(api.token(), "k-1", body())
    assert r.status_code == 201
    data = r.json()
    assert data["status"] == "succeeded" and data["payment_id"]
    assert (data["transaction_id"], data["amount"], data["currency"]) == ("tx-1", 150000, "IDR")
    assert "Idempotent-Replayed" not in r.headers
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}


def test_create_200_replay_returns_the_stored_answer(api: Api, gateway_sim: SimHandle) -> None:
    tok = api.token()
    first = api.create(tok, "k-1", body())
    again = api.create(tok, "k-1", body())
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}


@pytest.mark.parametrize(
    ("number", "reason"),
    [("REJECT-001", "beneficiary_blocked"), ("NOFUNDS-1", "insufficient_funds")],
)
def test_create_402_declines_and_stores_the_decline(
    api: Api, gateway_sim: SimHandle, number: str, reason: str
) -> None:
    tok = api.token()
    r = api.create(tok, "k-1", body(number=number))
    assert (r.status_code, r.json()) == (402, {"error": "declined", "reason": reason})
    again = api.create(tok, "k-1", body(number=number))
    assert (again.status_code, again.json()) == (402, r.json())
    assert again.headers["Idempotent-Replayed"] == "true"
    assert gateway_sim.ledger()["payments_sent"] == 0


@pytest.mark.parametrize(
    ("key", "data", "detail"),
    [
        (None, body(), "Idempotency-Key"),
        ("x" * 256, body(), "Idempotency-Key"),
        ("bad\u00e9key", body(), "Idempotency-Key"),
        ("k-1", {**body(), "amount": -5}, "amount"),
        ("k-1", {**body(), "amount": "5"}, "amount"),
        ("k-1", {k: v for k, v in body().items() if k != "beneficiary"}, "beneficiary"),
        ("k-1", {**body(), "currency": "rupiah"}, "currency"),
    ],
)
def test_create_400_on_a_malformed_request(
    api: Api, gateway_sim: SimHandle, key: str | None, data: dict[str, Any], detail: str
) -> None:
    tok = api.token()
    if key is not None and not key.isascii():
        # httpx refuses non-ASCII header values: send the raw bytes ourselves
        r = api.http.post(
            "/v1/accounts/acct-1/payments",
            json=data,
            headers={"Authorization": f"Bearer {tok}", "Idempotency-Key": key.encode("latin-1")},
        )
    else:
        r = api.create(tok, key, data)
    assert r.status_code == 400
    assert r.json()["error"] == "invalid_request" and detail in r.json()["detail"]
    assert gateway_sim.ledger()["payments_sent"] == 0


def test_create_401_without_a_valid_token(api: Api, gateway_sim: SimHandle) -> None:
    r = api.create("not-a-token", "k-1", body())
    assert (r.status_code, r.json()) == (401, {"error": "invalid_token"})
    r = api.http.post("/v1/accounts/acct-1/payments", json=body(), headers={"Idempotency-Key": "k"})
    assert r.status_code == 401
    assert gateway_sim.ledger()["payments_sent"] == 0


# long enough that a create counted by the simulator is still in flight when the next one
# (started only then) arrives, even on a loaded host
IN_FLIGHT_MS = 2000


def _creates_arrived(sim: SimHandle) -> int:
    """Creates the simulator has counted: it counts one as it arrives, in the same step of
    its event loop that takes the account's in-flight slot and stores the key as in flight
    (before the latency), so a counted create is in flight."""
    n: int = sim.ledger()["requests"].get("create", 0)
    return n


def _wait_for_creates(sim: SimHandle, n: int) -> None:
    """Wait until the simulator has counted ``n`` creates (the last of them in flight)."""
    wait_until(lambda: _creates_arrived(sim) >= n, 10, f"create {n} to arrive")


def _concurrently(sim: SimHandle, *calls: Any) -> list[httpx.Response]:
    """Start each create once the simulator has the one before it in flight."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = []
        for i, call in enumerate(calls):
            futures.append(pool.submit(call))
            _wait_for_creates(sim, i + 1)
        return [f.result() for f in futures]


def test_create_409_while_the_key_is_in_flight(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(latency_ms=IN_FLIGHT_MS, max_in_flight=5)
    tok = api.token()
    first, second = _concurrently(
        gateway_sim,
        lambda: api.create(tok, "k-1", body()),
        lambda: api.create(tok, "k-1", body()),
    )
    assert first.status_code == 201
    assert (second.status_code, second.json()) == (409, {"error": "idempotency_key_in_use"})
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}


def test_create_422_on_key_reuse_with_another_body(api: Api, gateway_sim: SimHandle) -> None:
    tok = api.token()
    assert api.create(tok, "k-1", body(amount=100)).status_code == 201
    r = api.create(tok, "k-1", body(amount=200))
    assert (r.status_code, r.json()) == (422, {"error": "idempotency_key_reused"})
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}


def test_create_429_when_more_in_flight_than_allowed(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(latency_ms=IN_FLIGHT_MS, max_in_flight=1)
    tok = api.token()
    first, second = _concurrently(
        gateway_sim,
        lambda: api.create(tok, "k-1", body("tx-1")),
        lambda: api.create(tok, "k-2", body("tx-2")),
    )
    assert first.status_code == 201
    assert (second.status_code, second.json()) == (429, {"error": "rate_limited"})
    assert int(second.headers["Retry-After"]) >= 1
    ledger = gateway_sim.ledger()
    assert ledger["http_429_by_cause"]["concurrency"] == 1
    assert ledger["max_in_flight_seen"]["acct-1"] == 2
    assert ledger["sends"] == {"acct-1/tx-1": 1}


def test_create_429_when_more_per_second_than_the_quota(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(rate=2)
    tok = api.token()
    codes = [api.create(tok, f"k-{i}", body(f"tx-{i}")).status_code for i in range(3)]
    assert codes == [201, 201, 429]
    r = api.create(tok, "k-9", body("tx-9"))
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert api.create(api.token("acct-2"), "k-0", body("tx-0"), "acct-2").status_code == 201
    assert gateway_sim.ledger()["http_429_by_cause"]["rate"] == 2


def test_create_503_applies_nothing(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(p503=1.0)
    tok = api.token()
    r = api.create(tok, "k-1", body())
    assert r.status_code == 503 and r.json()["error"]
    gateway_sim.configure(p503=0.0)
    assert api.lookup(tok, "k-1").status_code == 404
    assert gateway_sim.ledger()["payments_sent"] == 0


@pytest.mark.parametrize("status", [500, 502])
@pytest.mark.parametrize("applied", [True, False])
def test_create_500_502_outcome_unknown_may_be_applied(
    api: Api, gateway_sim: SimHandle, status: int, applied: bool
) -> None:
    gateway_sim.configure(**{f"p{status}": 1.0, "p_fault_applied": 1.0 if applied else 0.0})
    tok = api.token()
    r = api.create(tok, "k-1", body())
    assert r.status_code == status and r.json()["error"]
    gateway_sim.configure(**{f"p{status}": 0.0})
    assert api.lookup(tok, "k-1").status_code == (200 if applied else 404)
    assert gateway_sim.ledger()["payments_sent"] == (1 if applied else 0)


def test_create_504_has_no_body_and_may_be_applied(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(p504=1.0, p_fault_applied=1.0)
    tok = api.token()
    r = api.create(tok, "k-1", body())
    assert r.status_code == 504 and r.content == b""
    gateway_sim.configure(p504=0.0)
    assert api.lookup(tok, "k-1").json()["http_status"] == 201
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}


def test_create_timeout_payment_was_sent(gateway_sim: SimHandle) -> None:
    gateway_sim.configure(p_slow=1.0, slow_seconds=1.5)
    api = Api(gateway_sim, read_timeout=0.3)
    tok = api.token()
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        api.create(tok, "k-1", body())
    gateway_sim.configure(p_slow=0.0)
    # applied, and in flight until its answer is written: the account's one slot is taken
    busy = api.lookup(tok, "k-1")
    assert (busy.status_code, busy.headers["Retry-After"]) == (429, "1")
    causes = gateway_sim.ledger()["http_429_by_cause"]
    assert (causes["concurrency_late"], causes["concurrency"]) == (1, 0)
    # refused until the late answer is written, 1.5 s after the create arrived; then found
    r = busy
    while r.status_code == 429 and time.monotonic() < start + 6:
        time.sleep(0.1)
        r = api.lookup(tok, "k-1")
    assert time.monotonic() - start >= 1.4
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.json()["http_status"] == 201
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}
    api.http.close()


def test_create_reset_connection_payment_was_sent(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(p_lost=1.0)
    tok = api.token()
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        api.create(tok, "k-1", body())
    gateway_sim.configure(p_lost=0.0)
    assert api.lookup(tok, "k-1").json()["http_status"] == 201
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}


def test_a_key_changed_between_attempts_pays_twice(api: Api, gateway_sim: SimHandle) -> None:
    # why keys must be stable: the ledger counts sends per transaction, not per key
    tok = api.token()
    assert api.create(tok, "k-1", body()).status_code == 201
    assert api.create(tok, "k-2", body()).status_code == 201
    ledger = gateway_sim.ledger()
    assert ledger["sends"] == {"acct-1/tx-1": 2}
    assert ledger["double_payments"] == ["acct-1/tx-1"]


# --- lookup ---------------------------------------------------------------------------------
def test_lookup_200_returns_the_stored_answer_with_http_status(api: Api) -> None:
    tok = api.token()
    created = api.create(tok, "k-1", body()).json()
    assert api.create(tok, "k-2", body("tx-2", number="REJECT-9")).status_code == 402
    r = api.lookup(tok, "k-1")
    assert (r.status_code, r.json()) == (200, {**created, "http_status": 201})
    declined = api.lookup(tok, "k-2").json()
    assert declined == {"error": "declined", "reason": "beneficiary_blocked", "http_status": 402}


def test_lookup_404_for_a_key_never_applied(api: Api) -> None:
    r = api.lookup(api.token(), "never-sent")
    assert (r.status_code, r.json()) == (404, {"error": "not_found"})


def test_lookup_409_while_in_flight(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(max_in_flight=5)
    tok = api.token()
    with ThreadPoolExecutor(1) as pool:
        gateway_sim.configure(latency_ms=IN_FLIGHT_MS)
        fut = pool.submit(api.create, tok, "k-1", body())
        _wait_for_creates(gateway_sim, 1)
        gateway_sim.configure(latency_ms=0)  # the create drew its latency on arrival
        r = api.lookup(tok, "k-1")
        assert (r.status_code, r.json()) == (409, {"error": "idempotency_key_in_use"})
        assert fut.result().status_code == 201


def test_lookup_needs_a_valid_token(api: Api) -> None:
    assert api.lookup("nope", "k-1").status_code == 401


# --- control endpoints ----------------------------------------------------------------------
def test_config_rejects_unknown_flags_and_bad_values(gateway_sim: SimHandle) -> None:
    with httpx.Client(base_url=gateway_sim.url) as c:
        assert c.post("/_sim/config", json={"nope": 1}).status_code == 400
        assert c.post("/_sim/config", json={"p503": 2}).status_code == 400
        assert c.post("/_sim/config", json={"rate": 7}).json()["rate"] == 7.0


def test_reset_forgets_payments_and_tokens(api: Api, gateway_sim: SimHandle) -> None:
    tok = api.token()
    assert api.create(tok, "k-1", body()).status_code == 201
    gateway_sim.reset()
    assert gateway_sim.ledger()["payments_sent"] == 0
    assert api.create(tok, "k-1", body()).status_code == 401


def test_script_forces_the_next_answers(api: Api, gateway_sim: SimHandle) -> None:
    tok = api.token()
    gateway_sim.script("acct-1", {"fault": "429", "retry_after": 3}, {"fault": "503"})
    r = api.create(tok, "k-1", body())
    assert (r.status_code, r.headers["Retry-After"]) == (429, "3")
    assert api.create(tok, "k-1", body()).status_code == 503
    assert api.create(tok, "k-1", body()).status_code == 201
    statuses = [s for _, endpoint, s in gateway_sim.requests("acct-1") if endpoint == "create"]
    assert statuses == [429, 503, 201]


# --- in-doubt faults ------------------------------------------------------------------------
RESET = (httpx.ReadError, httpx.RemoteProtocolError)


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


# the in-doubt windows (hold, outage, retention): long enough for the checks meant to run
# inside one to do so on a loaded host
HOLD = 2.0
OUTAGE = 2.0
RETENTION = 1.5


def test_hold_409s_create_and_lookup_then_applies_once(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(p_hold=1.0, hold_seconds=HOLD)
    tok = api.token()
    with pytest.raises(RESET):  # the request that started the hold never gets its answer
        api.create(tok, "k-1", body())
    gateway_sim.configure(p_hold=0.0)
    in_use = (409, {"error": "idempotency_key_in_use"})
    r = api.create(tok, "k-1", body())
    assert (r.status_code, r.json()) == in_use
    r = api.create(tok, "k-1", body(amount=7))  # even with another body: still in flight
    assert (r.status_code, r.json()) == in_use
    r = api.lookup(tok, "k-1")
    assert (r.status_code, r.json()) == in_use
    ledger = gateway_sim.ledger()
    assert (ledger["payments_sent"], ledger["holds_pending"]) == (0, 1)

    ledger = gateway_sim.wait_for_holds(timeout=HOLD + 5)
    assert ledger["sends"] == {"acct-1/tx-1": 1}
    looked = api.lookup(tok, "k-1")
    assert looked.status_code == 200
    stored = looked.json()
    assert stored["http_status"] == 201 and stored["status"] == "succeeded"
    replay = api.create(tok, "k-1", body())
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert {**replay.json(), "http_status": 201} == stored
    ledger = gateway_sim.ledger()
    assert ledger["sends"] == {"acct-1/tx-1": 1} and ledger["double_payments"] == []
    assert ledger["faults"] == {"hold": 1}
    assert gateway_sim.statuses("acct-1", "create") == ["held", 409, 409, 200]
    assert gateway_sim.statuses("acct-1", "lookup") == [409, 200]


def test_a_scripted_hold_takes_its_own_seconds(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(hold_seconds=60)
    gateway_sim.script("acct-1", {"fault": "hold", "seconds": HOLD})  # endpoint: create
    tok = api.token()
    assert api.lookup(tok, "k-0").status_code == 404  # a lookup does not take it
    with pytest.raises(RESET):
        api.create(tok, "k-1", body())
    assert api.create(tok, "k-2", body("tx-2")).status_code == 201  # only the one is held
    assert api.lookup(tok, "k-1").status_code == 409
    ledger = gateway_sim.wait_for_holds(timeout=HOLD + 5)  # not the config's 60 s
    assert ledger["sends"] == {"acct-1/tx-1": 1, "acct-1/tx-2": 1}
    assert api.lookup(tok, "k-1").json()["http_status"] == 201


def test_a_reset_during_a_hold_drops_the_held_payment(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(p_hold=1.0, hold_seconds=0.5)
    with pytest.raises(RESET):
        api.create(api.token(), "k-1", body())
    gateway_sim.reset()
    time.sleep(0.8)
    assert gateway_sim.ledger()["payments_sent"] == 0


def test_outage_after_apply_pays_once_then_503s_then_recovers(
    api: Api, gateway_sim: SimHandle
) -> None:
    gateway_sim.configure(p_outage_after_apply=1.0, outage_seconds=OUTAGE)
    tok = api.token()
    t0 = time.monotonic()  # the outage starts after this
    with pytest.raises(RESET):  # applied, and its answer lost
        api.create(tok, "k-1", body())
    t1 = time.monotonic()  # and before this
    gateway_sim.configure(p_outage_after_apply=0.0)
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1}
    down = (503, {"error": "service_unavailable"})
    r = api.create(tok, "k-2", body("tx-2"))
    assert (r.status_code, r.json()) == down
    r = api.lookup(tok, "k-1")
    assert (r.status_code, r.json()) == down
    assert api.create("stale-token", "k-3", body("tx-3")).status_code == 503  # before auth
    # only that account is down, and the token endpoint is up
    assert api.token_response("acct-1").status_code == 200
    tok = api.token()
    assert api.create(api.token("acct-2"), "k-1", body(), "acct-2").status_code == 201
    assert time.monotonic() - t0 < OUTAGE, "the checks above must run inside the outage"
    assert gateway_sim.ledger()["payments_sent"] == 2  # tx-1 of acct-1, tx-1 of acct-2

    _sleep_until(t1 + OUTAGE + 0.2)
    r = api.lookup(tok, "k-1")
    assert (r.status_code, r.json()["http_status"]) == (200, 201)
    assert api.create(tok, "k-2", body("tx-2")).status_code == 201  # nothing applied before
    ledger = gateway_sim.ledger()
    assert ledger["sends"] == {"acct-1/tx-1": 1, "acct-1/tx-2": 1, "acct-2/tx-1": 1}
    assert ledger["double_payments"] == []
    assert ledger["faults"] == {"outage_after_apply": 1, "outage_503": 3}
    assert gateway_sim.statuses("acct-1", "create") == ["outage", 503, 503, 201]
    assert gateway_sim.statuses("acct-1", "lookup") == [503, 200]


def test_a_key_past_the_retention_is_forgotten_and_a_resend_pays_again(
    api: Api, gateway_sim: SimHandle
) -> None:
    gateway_sim.configure(key_retention_seconds=RETENTION)
    tok = api.token()
    first = api.create(tok, "k-1", body())
    t1 = time.monotonic()  # the key's answer was stored before this
    assert first.status_code == 201
    assert api.lookup(tok, "k-1").status_code == 200
    assert api.create(tok, "k-1", body()).status_code == 200  # a replay within the retention
    _sleep_until(t1 + RETENTION + 0.2)
    r = api.lookup(tok, "k-1")
    assert (r.status_code, r.json()) == (404, {"error": "not_found"})
    again = api.create(tok, "k-1", body())  # the same key, the same body: a new payment
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
    assert again.json()["payment_id"] != first.json()["payment_id"]
    ledger = gateway_sim.ledger()
    assert ledger["sends"] == {"acct-1/tx-1": 2}
    assert ledger["double_payments"] == ["acct-1/tx-1"]
    assert ledger["keys_forgotten"] == 1


def test_the_default_retention_keeps_keys(api: Api, gateway_sim: SimHandle) -> None:
    assert gateway_sim.ledger()["config"]["key_retention_seconds"] == 86400.0
    tok = api.token()
    assert api.create(tok, "k-1", body()).status_code == 201
    time.sleep(0.3)
    assert api.lookup(tok, "k-1").status_code == 200
    assert gateway_sim.ledger()["keys_forgotten"] == 0


def test_html_200_is_applied_and_the_lookup_finds_it(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.configure(p_html_200=1.0)
    tok = api.token()
    r = api.create(tok, "k-1", body())
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/html")
    assert r.text.lstrip().lower().startswith("<!doctype html>")
    assert "Idempotent-Replayed" not in r.headers
    with pytest.raises(ValueError):
        r.json()
    gateway_sim.configure(p_html_200=0.0)
    looked = api.lookup(tok, "k-1")
    assert looked.status_code == 200 and looked.json()["http_status"] == 201
    assert looked.json()["transaction_id"] == "tx-1"
    replay = api.create(tok, "k-1", body())
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    ledger = gateway_sim.ledger()
    assert ledger["sends"] == {"acct-1/tx-1": 1}
    assert ledger["faults"] == {"html_200": 1}
    assert gateway_sim.statuses("acct-1", "create") == [200, 200]


def test_scripted_html_200_and_outage_after_apply(api: Api, gateway_sim: SimHandle) -> None:
    gateway_sim.script(
        "acct-1", {"fault": "html_200"}, {"fault": "outage_after_apply", "seconds": OUTAGE}
    )
    tok = api.token()
    assert api.create(tok, "k-1", body()).headers["Content-Type"].startswith("text/html")
    with pytest.raises(RESET):
        api.create(tok, "k-2", body("tx-2"))
    t1 = time.monotonic()  # the outage started before this
    assert api.lookup(tok, "k-2").status_code == 503
    _sleep_until(t1 + OUTAGE + 0.2)
    assert api.lookup(tok, "k-2").json()["http_status"] == 201
    assert gateway_sim.ledger()["sends"] == {"acct-1/tx-1": 1, "acct-1/tx-2": 1}


@pytest.mark.parametrize(
    "answer",
    [
        {"fault": "hold", "endpoint": "lookup"},
        {"fault": "html_200", "endpoint": "any"},
        {"fault": "outage_after_apply", "endpoint": "token"},
        {"fault": "hold", "seconds": -1},
        {"fault": "hold", "seconds": "soon"},
        {"fault": "held"},
    ],
)
def test_script_rejects_bad_in_doubt_answers(gateway_sim: SimHandle, answer: Any) -> None:
    with httpx.Client(base_url=gateway_sim.url) as c:
        r = c.post("/_sim/script", json={"account_id": "acct-1", "answers": [answer]})
    assert r.status_code == 400 and "bad script" in r.json()["error"]


IN_DOUBT_CONFIG = {
    "p_hold": 0.5,
    "hold_seconds": 1.5,
    "p_outage_after_apply": 0.25,
    "outage_seconds": 2.0,
    "p_html_200": 0.125,
    "key_retention_seconds": 3.0,
}


def test_in_doubt_config_is_settable_and_checked(gateway_sim: SimHandle) -> None:
    assert gateway_sim.configure(**IN_DOUBT_CONFIG).items() >= IN_DOUBT_CONFIG.items()
    with httpx.Client(base_url=gateway_sim.url) as c:
        for name, bad in [
            ("p_hold", 1.5),
            ("p_outage_after_apply", -1),
            ("p_html_200", "often"),
            ("hold_seconds", -1),
            ("outage_seconds", -0.1),
            ("key_retention_seconds", 0),
        ]:
            r = c.post("/_sim/config", json={name: bad, "rate": 1})
            assert r.status_code == 400 and name in r.json()["error"], name
    config = gateway_sim.ledger()["config"]
    assert config.items() >= IN_DOUBT_CONFIG.items()
    assert config["rate"] == 20.0  # a rejected update changes nothing


def test_in_doubt_flags_set_the_config() -> None:
    with run_simulator(**IN_DOUBT_CONFIG) as sim:
        assert sim.ledger()["config"].items() >= IN_DOUBT_CONFIG.items()


def test_a_bad_in_doubt_flag_stops_the_simulator() -> None:
    # one case end to end; the unit tests check every field's values
    cmd = [sys.executable, "-m", "payment_worker.cli", "gateway-sim", "--port", "0"]
    cmd += ["--hold-seconds", "-1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "hold_seconds must be a finite number of seconds" in done.stdout
