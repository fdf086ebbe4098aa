"""A drain's token request sent before its first claim: the gateway's latency of the token is
spent while the claim runs, not before the first payment. Real Postgres and Redis, the
simulator over HTTP (its latency real: answers are held that long)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from payment_worker import runtime
from payment_worker.db.work_store import PgWorkStore
from payment_worker.worker import drain
from tests.conftest import PwEnv, submit_accounts
from tests.sim_fixtures import SimHandle

pytestmark = pytest.mark.integration

LATENCY = 1.0  # s, every answer of the simulator
CLAIM = 1.0  # s, the first claim held this long


@pytest.fixture
def res(pw_env: PwEnv, gateway_sim: SimHandle) -> Iterator[runtime.Runtime]:
    runtime.reset()
    yield runtime.current()
    runtime.reset()


def _slow_first_claim(
    monkeypatch: pytest.MonkeyPatch, seen: list[list[tuple[str, int]]], sim: SimHandle
) -> None:
    """Each first claim records the requests the simulator has seen for the account (each
    as endpoint and status, 0 while it is not answered yet), then takes CLAIM seconds (a
    busy database)."""
    original = PgWorkStore.fence_and_claim

    def slow(self: PgWorkStore, account_id: str, limit: int) -> Any:
        seen.append([(r[1], r[2]) for r in sim.requests(account_id)])
        time.sleep(CLAIM)
        return original(self, account_id, limit)

    monkeypatch.setattr(PgWorkStore, "fence_and_claim", slow)


def test_the_token_request_leaves_before_the_first_claim_and_its_latency_overlaps_it(
    res: runtime.Runtime, gateway_sim: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    [warm, batch] = submit_accounts(2, 1, "prefetch")
    drain.run_account(warm["account_id"], warm["batch_id"], res)  # connections, scripts
    gateway_sim.configure(latency_ms=LATENCY * 1000)
    seen: list[list[tuple[str, int]]] = []
    _slow_first_claim(monkeypatch, seen, gateway_sim)
    started = time.monotonic()
    report = drain.run_account(batch["account_id"], batch["batch_id"], res)
    took = time.monotonic() - started
    assert report.result == "processed" and report.finished == {"succeeded": 1}
    # the simulator had the token request before the claim began, and had not answered it
    # yet: the claim did not wait for the token (an answer waited for before the claim
    # would read 200 here; a request sent after the claim would be missing)
    assert seen == [[("token", 0)]]
    # claim, then payment: the token's answer came during the claim. Waited for before or
    # after the claim it would have cost one more latency (CLAIM + 2 x LATENCY = 3 s at
    # least, against CLAIM + LATENCY = 2 s here)
    assert took < CLAIM + 2 * LATENCY, took
    ledger = gateway_sim.ledger()
    assert ledger["tokens_issued_per_account"][batch["account_id"]] == 1
    # stored for every process, and the refresh lock let go by the store
    tokens = res.gateway.tokens
    assert tokens.cached(batch["account_id"]) is not None
    assert not res.redis.exists(tokens.lock_key(batch["account_id"]))


def test_a_drain_with_nothing_due_stores_the_token_it_asked_for_and_frees_the_lock(
    res: runtime.Runtime, gateway_sim: SimHandle
) -> None:
    [batch] = submit_accounts(1, 2, "prefetch-idle")
    account = batch["account_id"]
    first = drain.run_account(account, batch["batch_id"], res)
    assert first.result == "processed" and first.items == 2
    # the token gone everywhere (expired, say): the next start takes the refresh lock
    tokens = res.gateway.tokens
    res.redis.delete(tokens.token_key(account))
    tokens._local.clear()
    again = drain.run_account(account, batch["batch_id"], res)
    assert again.result == "idle" and again.items == 0
    # the request sent before the claim was answered and kept, not thrown away: one more
    # token issued, stored, and the refresh lock released at once (not at its TTL)
    assert gateway_sim.ledger()["tokens_issued_per_account"][account] == 2
    assert tokens.cached(account) is not None
    assert not res.redis.exists(tokens.lock_key(account))
    # and the connection it used went back to the pool: nothing half read on it
    third = drain.run_account(account, batch["batch_id"], res)
    assert third.result == "idle"
    assert gateway_sim.ledger()["tokens_issued_per_account"][account] == 2


def test_a_refused_token_request_sent_early_fails_the_first_payment_as_before(
    res: runtime.Runtime, gateway_sim: SimHandle
) -> None:
    [batch] = submit_accounts(1, 1, "prefetch-refused")
    account = batch["account_id"]
    gateway_sim.script(account, {"fault": "503", "endpoint": "token"})
    report = drain.run_account(account, batch["batch_id"], res)
    # the refusal was the first payment's "not sent, retry" (no payment without a token);
    # its retry under the lock asked again (no early request this time) and paid once
    assert report.result == "processed" and report.finished == {"succeeded": 1}
    assert gateway_sim.statuses(account, "token") == [503, 200]
    ledger = gateway_sim.ledger()
    assert ledger["payments_sent"] == 1 and ledger["double_payments"] == []
    assert not res.redis.exists(res.gateway.tokens.lock_key(account))
