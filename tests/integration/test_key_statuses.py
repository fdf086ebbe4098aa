"""Idempotency-key statuses written with the outcomes, by the drain, in the real database.

docs/processing.md, step 4: the record statement writes the keys' results with the outcomes:
``applied``, ``declined``, ``rejected``, ``not_applied``, or ``sent`` while the outcome is
unknown, with the attempt count. Each outcome is produced by the gateway simulator over
HTTP (a scripted fault, a beneficiary it declines, a key it already holds for another body).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from payment_worker import runtime
from payment_worker.domain.idempotency import idempotency_key
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.producer.submit import submit_batch
from payment_worker.worker import drain
from tests.conftest import PwEnv
from tests.sim_fixtures import SimHandle

ACCOUNT = "acct-k"
BENEFICIARY = {"bank_code": "014", "account_number": "1234567890", "name": "Budi"}


@pytest.fixture
def res(
    pw_env: PwEnv, gateway_sim: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> Iterator[runtime.Runtime]:
    # retries and lookups far in the future, and no waiting under the lock: one run leaves
    # each item in the state its first answer gave it (the full-jitter delay is uniform in
    # [0, 300 s], so an immediate retry within the run has odds of about 1e-5)
    monkeypatch.setenv("RETRY_BASE_DELAY", "300")
    monkeypatch.setenv("RETRY_MAX_DELAY", "300")
    monkeypatch.setenv("HOLD_WAIT_MAX_SECONDS", "0")
    monkeypatch.setenv("GATEWAY_READ_TIMEOUT", "0.5")
    runtime.reset()  # rebuilt from the settings above
    rt = runtime.current()
    assert rt.settings.gateway_url == gateway_sim.url
    yield rt
    runtime.reset()


def _item(tx: str, amount: int = 1000, account_number: str = "1234567890") -> dict[str, Any]:
    return {
        "transaction_id": tx,
        "amount": amount,
        "currency": "IDR",
        "beneficiary": {**BENEFICIARY, "account_number": account_number},
    }


def _submit(batch_id: str, items: list[dict[str, Any]]) -> None:
    data = {"batch_id": batch_id, "account_id": ACCOUNT, "items": items}
    assert submit_batch(data, enqueue=False).status == "accepted"


def _rows(db: psycopg.Connection[Any]) -> dict[str, tuple[Any, ...]]:
    """transaction_id -> (tx status, key status, key attempts, key result_ref = expected ref)."""
    rows = db.execute(
        "SELECT t.transaction_id, t.status, k.status, k.attempts, t.attempts,"
        " k.result_ref IS NOT DISTINCT FROM COALESCE(t.gateway_payment_id, t.last_error_class),"
        " k.fence_token = t.fence_token AND k.fence_token > 0"
        " FROM transactions t JOIN idempotency_keys k ON k.transaction_pk = t.id"
        " WHERE t.account_id = %s ORDER BY t.id",
        (ACCOUNT,),
    ).fetchall()
    out = {}
    for tx, t_status, k_status, k_attempts, t_attempts, ref_ok, fenced in rows:
        # the key's attempts follow the transaction's, and its result and fence are the
        # outcome's (payment id, else error class) and the writer's token
        assert k_attempts == t_attempts, tx
        assert ref_ok and fenced, tx
        out[tx] = (t_status, k_status, k_attempts)
    return out


def _sends(sim: SimHandle) -> list[tuple[str, Any]]:
    """The account's payment and lookup requests with their HTTP status (tokens left out)."""
    return [(e, status) for _, e, status in sim.requests(ACCOUNT) if e != "token"]


def test_key_status_is_written_with_each_outcome(
    res: runtime.Runtime, gateway_sim: SimHandle, db_conn: psycopg.Connection[Any]
) -> None:
    items = [
        _item("tx-503"),
        _item("tx-504"),
        _item("tx-ok"),
        _item("tx-declined", account_number="REJECT0001"),
        _item("tx-reused", amount=5000),
    ]
    _submit("b-keys", items)
    keys = db_conn.execute("SELECT DISTINCT status, attempts FROM idempotency_keys").fetchall()
    assert keys == [("new", 0)]
    # the gateway already holds tx-reused's key for another body: it answers 422
    other_body = PaymentRequest(ACCOUNT, "tx-reused", 4000, "IDR", BENEFICIARY)
    key = idempotency_key(ACCOUNT, "tx-reused")
    assert res.gateway.create_payment(ACCOUNT, other_body, key).http_status == 201
    # items are sent in batch order: the first two sends get these answers
    gateway_sim.script(
        ACCOUNT,
        {"fault": "503", "endpoint": "create"},
        {"fault": "504", "applied": True, "endpoint": "create"},
    )

    report = drain.run_account(ACCOUNT, "b-keys", res)
    assert report.result == "processed" and report.items == 5

    assert _rows(db_conn) == {
        "tx-503": ("retryable", "not_applied", 1),
        "tx-504": ("unknown", "sent", 1),  # money left, but only a lookup may say so
        "tx-ok": ("succeeded", "applied", 1),
        "tx-declined": ("failed", "declined", 1),
        # 422, then the lookup shows the gateway holds another body's payment under the
        # key: a conflict for a person, never "failed" (the gateway did not say no)
        # (the key says so too)
        "tx-reused": ("dead", "conflict", 1),
    }
    # the pre-send, then one send per item
    assert _sends(gateway_sim) == [
        ("create", 201),
        ("create", 503),
        ("create", 504),
        ("create", 201),
        ("create", 402),
        ("create", 422),
        ("lookup", 200),
    ]


def test_in_doubt_key_stays_sent_until_a_lookup_settles_it(
    res: runtime.Runtime,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _submit("b-doubt", [_item("tx-paid"), _item("tx-never")])
    gateway_sim.script(
        ACCOUNT,
        {"fault": "504", "applied": True, "endpoint": "create"},
        {"fault": "504", "applied": False, "endpoint": "create"},
    )
    drain.run_account(ACCOUNT, "b-doubt", res)
    assert _rows(db_conn) == {
        "tx-paid": ("unknown", "sent", 1),
        "tx-never": ("unknown", "sent", 1),
    }

    # next holder, lookups due now; no attempt left, so "never applied" is not resent
    monkeypatch.setattr(res.settings, "retry_max_attempts", 1)
    db_conn.execute("UPDATE transactions SET next_attempt_at = now()")
    drain.run_account(ACCOUNT, "b-doubt", res)
    assert _rows(db_conn) == {
        "tx-paid": ("succeeded", "applied", 1),
        "tx-never": ("dead", "not_applied", 1),
    }
    dead = db_conn.execute("SELECT reason FROM dead_letters").fetchall()
    assert dead == [("retries_exhausted",)]
    ledger = gateway_sim.ledger()
    assert ledger["payments_sent"] == 1 and ledger["double_payments"] == []
    # looked up, never resent
    assert _sends(gateway_sim) == [
        ("create", 504),
        ("create", 504),
        ("lookup", 200),
        ("lookup", 404),
    ]
