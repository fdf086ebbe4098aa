"""In-doubt payments with real workers against the simulator: never twice, never lost, at the
edges (a key held in flight, an outage after an applied payment, a gateway that forgets keys,
409/422/HTML answers, huge Retry-After, a failing token endpoint).

Each test starts its own simulator with the fault it needs, a real Celery worker, submits a
batch, waits for the items to settle, and checks Postgres against the simulator's ledger.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from payment_worker import runtime
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.domain.idempotency import idempotency_key
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.producer.submit import submit_batch
from payment_worker.settings import Settings
from tests.conftest import PwEnv, wait_until
from tests.sim_fixtures import SimHandle, gateway_client, run_simulator

ACCT = "acct-doubt"
BENEFICIARY = {"bank_code": "014", "account_number": "1234567890", "name": "Budi"}
FINAL = ("succeeded", "failed", "dead")


def _batch(batch_id: str, n: int = 1, **item: Any) -> dict[str, Any]:
    items = [
        {
            "transaction_id": f"{batch_id}-tx-{i}",
            "amount": 150_000 + i,
            "currency": "IDR",
            "beneficiary": BENEFICIARY,
            **item,
        }
        for i in range(n)
    ]
    return {"batch_id": batch_id, "account_id": ACCT, "items": items}


@contextmanager
def _world(
    pw_env: PwEnv, tmp_path: Path, sim_flags: dict[str, Any], **env: str
) -> Iterator[tuple[SimHandle, LocalCluster]]:
    """A simulator with ``sim_flags`` and one real worker with ``env`` on top of the test's."""
    with run_simulator(seed=3, **sim_flags) as sim:
        worker_env = {
            **os.environ,
            "GATEWAY_URL": sim.url,
            "METRICS_PORT": "0",
            "RETRY_BASE_DELAY": "0.2",
            "RETRY_MAX_DELAY": "1",
            "LOOKUP_MAX_DELAY": "2",
            "HOLD_WAIT_MAX_SECONDS": "3",
            "GATEWAY_READ_TIMEOUT": "1.0",
            **env,
        }
        with LocalCluster(workdir=tmp_path, env=worker_env, concurrency=2) as cluster:
            cluster.start_worker()
            yield sim, cluster


def _rows(batch_id: str) -> dict[str, tuple[str, int]]:
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        rows = conn.execute(
            "SELECT t.transaction_id, t.status, t.attempts FROM transactions t"
            " JOIN batches b ON b.id = t.batch_pk WHERE b.batch_id = %s",
            (batch_id,),
        ).fetchall()
    return {str(r[0]): (str(r[1]), int(r[2])) for r in rows}


def _dead_reasons() -> list[str]:
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        return [str(r[0]) for r in conn.execute("SELECT reason FROM dead_letters ORDER BY id")]


def _settle(
    batch_id: str, timeout: float, *, never: str | None = None, until: tuple[str, ...] = FINAL
) -> dict[str, tuple[str, int]]:
    """Poll until every item is in one of ``until``; fail at once if one is ever ``never``."""
    deadline = time.monotonic() + timeout
    rows: dict[str, tuple[str, int]] = {}
    while time.monotonic() < deadline:
        rows = _rows(batch_id)
        if never is not None:
            assert all(s != never for s, _ in rows.values()), rows
        if rows and all(s in until for s, _ in rows.values()):
            return rows
        time.sleep(0.25)
    pytest.fail(f"not settled in {timeout}s: {rows}")


def _submit(batch: dict[str, Any]) -> None:
    assert submit_batch(batch, runtime=runtime.current()).status == "accepted"


def test_a_key_held_in_flight_for_60s_is_paid_once_and_never_dead(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    with _world(pw_env, tmp_path, {}) as (sim, _):
        # the first create is held: 409 to every create and lookup of its key for 60 s, then
        # applied with its response lost
        sim.script(ACCT, {"fault": "hold", "seconds": 60, "endpoint": "create"})
        _submit(_batch("held", n=2))
        # the item in doubt does not hold up the rest of its account
        deadline = time.monotonic() + 20
        while _rows("held").get("held-tx-1", ("",))[0] != "succeeded":
            assert time.monotonic() < deadline, _rows("held")
            time.sleep(0.25)
        assert _rows("held")["held-tx-0"][0] == "unknown"
        rows = _settle("held", timeout=100, never="dead")
        sim.wait_for_holds()
        ledger = sim.ledger()
    assert {s for s, _ in rows.values()} == {"succeeded"}
    assert ledger["payments_sent"] == 2 and ledger["double_payments"] == []
    assert ledger["faults"].get("hold") == 1


def test_applied_then_an_outage_past_the_retention_ends_dead_paid_once(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    # the gateway forgets keys after 20 s; an in-doubt item goes to a person well before
    env = {"GATEWAY_KEY_RETENTION_SECONDS": "20", "IN_DOUBT_MAX_SECONDS": "9"}
    with _world(pw_env, tmp_path, {"key_retention_seconds": 20}, **env) as (sim, _):
        sim.script(ACCT, {"fault": "outage_after_apply", "seconds": 45, "endpoint": "create"})
        _submit(_batch("outage"))
        rows = _settle("outage", timeout=40)
        ledger = sim.ledger()
    assert [s for s, _ in rows.values()] == ["dead"]
    assert _dead_reasons() == ["unknown_unresolved"]
    assert ledger["payments_sent"] == 1 and ledger["double_payments"] == []


def test_a_404_after_the_gateway_forgot_the_key_never_sends(pw_env: PwEnv, tmp_path: Path) -> None:
    # the in-doubt bound raised past the outage (a test-only override of the settings check):
    # the first lookup that gets through comes after the gateway forgot the key
    env = {
        "GATEWAY_KEY_RETENTION_SECONDS": "20",
        "IN_DOUBT_MAX_SECONDS": "120",
        "UNSAFE_ALLOW_IN_DOUBT_PAST_RETENTION": "true",
    }
    with _world(pw_env, tmp_path, {"key_retention_seconds": 20}, **env) as (sim, _):
        sim.script(ACCT, {"fault": "outage_after_apply", "seconds": 30, "endpoint": "create"})
        _submit(_batch("forgot"))
        rows = _settle("forgot", timeout=80)
        ledger = sim.ledger()
        lookups = sim.statuses(ACCT, "lookup")
    assert [s for s, _ in rows.values()] == ["dead"]
    assert _dead_reasons() == ["in_doubt_key_expired"]
    assert 404 in lookups  # the gateway said "not found"...
    assert ledger["payments_sent"] == 1 and ledger["double_payments"] == []  # ...and no resend


def test_an_item_whose_sends_were_all_503_is_sent_after_the_retention(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    env = {
        "GATEWAY_KEY_RETENTION_SECONDS": "2",
        "IN_DOUBT_MAX_SECONDS": "0.5",
        "RETRY_MAX_ATTEMPTS": "100",
    }
    with _world(pw_env, tmp_path, {"key_retention_seconds": 2, "p503": 1.0}, **env) as (sim, _):
        _submit(_batch("all-503"))

        def sends() -> list[Any]:
            """The creates' answers so far (0: one still being answered)."""
            return sim.statuses(ACCT, "create")

        # twice the retention after its first send, on the simulator's clock (the worker's
        # start-up is not counted), every send answered 503 (nothing applied)
        wait_until(lambda: bool(sends()), 30, "the first send")
        first = next(t for t, e, _ in sim.requests(ACCT) if e == "create")
        time.sleep(max(0.0, first + 4.0 - sim.now()))
        # between two sends, or in one (claimed, not yet recorded): never dead, never paid
        assert {s for s, _ in _rows("all-503").values()} <= {"retryable", "dispatching"}
        answered = [s for s in sends() if s != 0]
        assert len(answered) >= 2 and set(answered) == {503}, answered
        sim.configure(p503=0.0)
        rows = _settle("all-503", timeout=20)
        ledger = sim.ledger()
    assert [s for s, _ in rows.values()] == ["succeeded"]
    assert ledger["payments_sent"] == 1 and _dead_reasons() == []


def _pre_send(sim: SimHandle, tx: PaymentRequest, **script: Any) -> Any:
    """A create under the item's own key, from outside the worker (another instance)."""
    settings = Settings().model_copy(update={"gateway_url": sim.url})
    client = gateway_client(settings)
    try:
        if script:
            sim.script(ACCT, {"endpoint": "create", **script})
        return client.create_payment(ACCT, tx, idempotency_key(ACCT, tx.transaction_id))
    finally:
        client.close()


def test_409_on_the_last_attempt_is_resolved_by_lookup(pw_env: PwEnv, tmp_path: Path) -> None:
    with _world(pw_env, tmp_path, {}, RETRY_MAX_ATTEMPTS="1") as (sim, _):
        b = _batch("last-409")
        item = b["items"][0]
        tx = PaymentRequest(ACCT, item["transaction_id"], item["amount"], "IDR", BENEFICIARY)
        # the key is in flight at the gateway (held 5 s) when the worker's only attempt comes
        _pre_send(sim, tx, fault="hold", seconds=5)
        _submit(b)
        rows = _settle("last-409", timeout=40, never="dead")
        sim.wait_for_holds()
        ledger = sim.ledger()
        creates = sim.statuses(ACCT, "create")
    assert [s for s, _ in rows.values()] == ["succeeded"]
    assert 409 in creates and ledger["payments_sent"] == 1


def test_422_is_looked_up_and_the_stored_answer_decides(pw_env: PwEnv, tmp_path: Path) -> None:
    with _world(pw_env, tmp_path, {}) as (sim, _):
        b = _batch("k422", n=2)
        ours, theirs = b["items"]
        # the gateway already holds, under each key, a payment with another body: the same
        # transaction with a description (ours), and another amount (a conflict)
        same = PaymentRequest(ACCT, ours["transaction_id"], ours["amount"], "IDR", BENEFICIARY, "x")
        other = PaymentRequest(ACCT, theirs["transaction_id"], 1, "IDR", BENEFICIARY)
        assert _pre_send(sim, same).http_status == 201
        assert _pre_send(sim, other).http_status == 201
        _submit(b)
        rows = _settle("k422", timeout=30)
        ledger = sim.ledger()
    assert rows[ours["transaction_id"]][0] == "succeeded"
    assert rows[theirs["transaction_id"]][0] == "dead" and _dead_reasons() == ["key_conflict"]
    assert ledger["payments_sent"] == 2 and ledger["double_payments"] == []


def test_a_conflict_whose_first_lookup_failed_is_still_caught(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    """Another body was paid under the item's key (another amount). The create answers 422,
    and the lookup right after it answers 503, so the item is only in doubt; its next lookup
    finds the other payment. Before, that lookup took any stored payment for ours: the item
    was recorded succeeded with someone else's payment id, and never paid (a review found
    it). Now it is a key conflict for a person."""
    with _world(pw_env, tmp_path, {}) as (sim, _):
        b = _batch("k422-503")
        item = b["items"][0]
        other = PaymentRequest(ACCT, item["transaction_id"], 1, "IDR", BENEFICIARY)
        assert _pre_send(sim, other).http_status == 201
        sim.script(ACCT, {"fault": "503", "endpoint": "lookup"})
        _submit(b)
        rows = _settle("k422-503", timeout=30)
        ledger = sim.ledger()
        creates = sim.statuses(ACCT, "create")
        lookups = sim.statuses(ACCT, "lookup")
    assert 422 in creates and lookups[:2] == [503, 200], (creates, lookups)
    assert [s for s, _ in rows.values()] == ["dead"] and _dead_reasons() == ["key_conflict"]
    assert ledger["payments_sent"] == 1 and ledger["double_payments"] == []


def test_a_conflict_the_gateway_forgot_before_a_lookup_got_through_is_never_resent(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    """The gateway holds another body of the item's transaction under its key (paid); the
    create answers 422 and the lookups after it get 503, until the gateway forgets the key
    (its retention here 3 s, well short of what the worker trusts). Before, the 404 that
    followed was read as "never applied" and the item sent: the transaction paid twice (a
    review found it). Now the key is remembered as in conflict, and a person decides."""
    with _world(pw_env, tmp_path, {"key_retention_seconds": 3}) as (sim, _):
        b = _batch("k422-forgot")
        item = b["items"][0]
        other = PaymentRequest(ACCT, item["transaction_id"], 1, "IDR", BENEFICIARY)
        assert _pre_send(sim, other).http_status == 201
        # more 503s than fit in the retention (each lookup waits up to LOOKUP_MAX_DELAY)
        sim.script(ACCT, *[{"fault": "503", "endpoint": "lookup"}] * 12)
        _submit(b)
        rows = _settle("k422-forgot", timeout=60)
        ledger = sim.ledger()
        creates = sim.statuses(ACCT, "create")
        lookups = sim.statuses(ACCT, "lookup")
    assert creates == [201, 422] and lookups[-1] == 404, (creates, lookups)
    assert [s for s, _ in rows.values()] == ["dead"] and _dead_reasons() == ["key_conflict"]
    assert ledger["payments_sent"] == 1 and ledger["double_payments"] == []


def test_an_html_200_is_looked_up_not_believed(pw_env: PwEnv, tmp_path: Path) -> None:
    with _world(pw_env, tmp_path, {}) as (sim, _):
        sim.script(ACCT, {"fault": "html_200", "endpoint": "create"})
        _submit(_batch("html"))
        rows = _settle("html", timeout=30)
        ledger = sim.ledger()
        lookups = sim.statuses(ACCT, "lookup")
    assert [s for s, _ in rows.values()] == ["succeeded"]
    assert 200 in lookups and ledger["payments_sent"] == 1


def test_a_retry_after_of_two_days_is_honoured_only_up_to_the_cap(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    with _world(pw_env, tmp_path, {}, RETRY_AFTER_MAX_SECONDS="2") as (sim, _):
        sim.script(ACCT, {"fault": "429", "retry_after": 172800, "endpoint": "create"})
        started = time.monotonic()
        _submit(_batch("huge-retry-after"))
        rows = _settle("huge-retry-after", timeout=30)
        took = time.monotonic() - started
        ledger = sim.ledger()
    assert [s for s, _ in rows.values()] == ["succeeded"] and ledger["payments_sent"] == 1
    assert 2.0 <= took < 20.0


def test_a_failing_token_endpoint_uses_up_no_attempt(pw_env: PwEnv, tmp_path: Path) -> None:
    with _world(pw_env, tmp_path, {}, RETRY_MAX_ATTEMPTS="2") as (sim, _):
        sim.configure(secret="rotated")  # every token request: 401 invalid_client
        _submit(_batch("no-token", n=3))
        # more token failures than RETRY_MAX_ATTEMPTS (counted, not slept for: a worker slow
        # to start would have passed the test without the point being made)
        wait_until(lambda: sim.statuses(ACCT, "token").count(401) >= 3, 30, "three token failures")
        assert {s for s, _ in _rows("no-token").values()} <= {"retryable", "dispatching"}
        sim.configure(secret="sim-secret")
        rows = _settle("no-token", timeout=30)
        ledger = sim.ledger()
    assert {v for v in rows.values()} == {("succeeded", 1)}  # one attempt each: the real one
    assert _dead_reasons() == [] and ledger["payments_sent"] == 3


def test_a_slow_answer_past_the_read_timeout_is_waited_for_not_resent(
    pw_env: PwEnv, tmp_path: Path
) -> None:
    """The first create is applied and answered 4 s late; the worker stops waiting after its
    read timeout (1 s). The gateway is still answering it, so the account's one request in
    flight is taken: the lookups (and the next item's create) meet 429 until the answer is
    written, and only then does a lookup find the payment. Patient, and paid once."""
    with _world(pw_env, tmp_path, {"slow_seconds": 4}) as (sim, _):
        sim.script(ACCT, {"fault": "slow", "endpoint": "create"})
        _submit(_batch("late", n=2))
        rows = _settle("late", timeout=40, never="dead")
        ledger = sim.ledger()
        lookups = sim.statuses(ACCT, "lookup")
        creates = sim.statuses(ACCT, "create")
    assert {s for s, _ in rows.values()} == {"succeeded"}
    assert ledger["payments_sent"] == 2 and ledger["double_payments"] == []
    # not resent: a create under the late one's key would be answered as a replay (200)
    assert [s for s in creates if s in (200, 201)] == [201, 201], creates
    causes = ledger["http_429_by_cause"]
    assert causes["concurrency_late"] >= 1 and causes["concurrency"] == 0, causes
    assert 200 in lookups, lookups
