"""Items retried in vain: a step whose request never reaches the gateway uses up no attempt,
so ``unsent_since`` dates the first such step since a request last left, and the exporter's
``payment_worker_oldest_unsent_age_seconds`` (alert PaymentAccountStalled) shows it. Real
Postgres and Redis, the simulator over HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection

from payment_worker import runtime
from payment_worker.db import work as repo
from payment_worker.db.dead_letters import replay
from payment_worker.db.engine import autocommit
from payment_worker.db.fences import next_fence_token
from payment_worker.db.reports import state_snapshot
from payment_worker.domain.statuses import DeadReason, TxStatus
from payment_worker.domain.transitions import Decision, ItemOutcome, handed_back
from payment_worker.worker import drain
from tests.conftest import PwEnv, submit_accounts
from tests.sim_fixtures import SimHandle

pytestmark = pytest.mark.integration

REFUSED = {"fault": "503", "endpoint": "token"}


@pytest.fixture
def res(
    pw_env: PwEnv, gateway_sim: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> Iterator[runtime.Runtime]:
    # a retry is scheduled, not waited for under the lock: one run_account is one step
    monkeypatch.setenv("RETRY_BASE_DELAY", "30")
    monkeypatch.setenv("RETRY_MAX_DELAY", "30")
    monkeypatch.setenv("HOLD_WAIT_MAX_SECONDS", "0.5")
    runtime.reset()
    yield runtime.current()
    runtime.reset()


Row = tuple[str, int, datetime | None, datetime | None, str | None]


def _rows(db: psycopg.Connection[Any], account: str) -> list[Row]:
    """(status, attempts, unsent_since, dispatched_at, last_error) of the account's items."""
    return [
        (r[0], r[1], r[2], r[3], r[4])
        for r in db.execute(
            "SELECT status, attempts, unsent_since, dispatched_at, last_error"
            " FROM transactions WHERE account_id = %s ORDER BY id",
            (account,),
        )
    ]


def _due_now(db: psycopg.Connection[Any], account: str) -> None:
    db.execute("UPDATE transactions SET next_attempt_at = now() WHERE account_id = %s", (account,))


def _snapshot(rt: runtime.Runtime) -> Any:
    with rt.engine.connect() as conn:
        return state_snapshot(conn, statement_timeout_ms=5000)


def test_items_whose_token_is_refused_are_dated_until_a_request_leaves(
    res: runtime.Runtime, gateway_sim: SimHandle, db_conn: psycopg.Connection[Any]
) -> None:
    stuck, healthy = submit_accounts(2, 2, "unsent")
    account = stuck["account_id"]
    gateway_sim.script(account, *[REFUSED] * 100)  # refused however often it asks

    assert drain.run_account(account, stuck["batch_id"], res).result == "processed"
    first = _rows(db_conn, account)
    for status, attempts, unsent_since, dispatched_at, error in first:
        # nothing left: no attempt used, and the first step's record dates the stall (a
        # retry due within HOLD_WAIT_MAX_SECONDS is stepped again in the same run)
        assert status == "retryable" and attempts == 0
        assert unsent_since is not None and dispatched_at is not None
        assert unsent_since >= dispatched_at - timedelta(seconds=1)
        # the first item's token request was refused; the next one waited out the pause
        assert error is not None and "token request: HTTP 503" in error
    assert gateway_sim.statuses(account, "payments") == []

    report = drain.run_account(healthy["account_id"], healthy["batch_id"], res)
    assert report.finished == {"succeeded": 2}
    assert [r[2] for r in _rows(db_conn, healthy["account_id"])] == [None, None]
    seen = _snapshot(res)
    assert seen.accounts_unsent == 1 and seen.accounts_waiting == 1
    assert seen.oldest_unsent_age > 0

    # nothing leaves again (its token requests paused): the first date stays, the claim's
    # moved on
    time.sleep(0.05)
    _due_now(db_conn, account)
    drain.run_account(account, stuck["batch_id"], res)
    second = _rows(db_conn, account)
    assert [r[2] for r in second] == [r[2] for r in first]
    assert all(
        r[3] is not None and b[3] is not None and r[3] > b[3]
        for r, b in zip(second, first, strict=True)
    )
    assert all(r[0] == "retryable" and r[1] == 0 for r in second)
    assert _snapshot(res).oldest_unsent_age >= seen.oldest_unsent_age

    # the gateway answers again: the payment leaves, once, and the date is cleared (a new
    # process: this one's token requests of the account are paused for a second or two)
    gateway_sim.reset()
    _due_now(db_conn, account)
    runtime.reset()
    res = runtime.current()
    assert drain.run_account(account, stuck["batch_id"], res).finished == {"succeeded": 2}
    assert [(r[0], r[1], r[2]) for r in _rows(db_conn, account)] == [("succeeded", 1, None)] * 2
    assert gateway_sim.ledger()["payments_sent"] == 2
    after = _snapshot(res)
    assert after.accounts_unsent == 0 and after.oldest_unsent_age == 0


def _claim_one(conn: Connection, db: psycopg.Connection[Any], account: str, token: int) -> int:
    _due_now(db, account)
    [item] = repo.claim_due(conn, account, token, 10)
    return item.id


def _unsent(db: psycopg.Connection[Any], tx: int) -> datetime | None:
    row = db.execute("SELECT unsent_since FROM transactions WHERE id = %s", (tx,)).fetchone()
    assert row is not None
    value: datetime | None = row[0]
    return value


def test_the_first_date_is_kept_until_a_request_leaves_the_item_ends_or_is_replayed(
    res: runtime.Runtime, db_conn: psycopg.Connection[Any]
) -> None:
    [batch] = submit_accounts(1, 1, "unsent-rec")
    account = batch["account_id"]
    later = Decision(TxStatus.RETRYABLE, error_class="token_invalid_client")
    with autocommit(res.engine).connect() as conn:
        token = next_fence_token(conn, account)

        def step(decision: Decision, reached: bool) -> datetime | None:
            tx = _claim_one(conn, db_conn, account, token)
            repo.record_outcomes(conn, account, token, [ItemOutcome(tx, 0, 0, decision, reached)])
            return _unsent(db_conn, tx)

        dated = step(later, False)
        assert dated is not None
        time.sleep(0.01)
        assert step(later, False) == dated  # in vain again: the first date stays
        # given back untouched at a shutdown (the drain's outcome, reached left at its
        # default): counted as in vain, so a shutdown never hides a stall
        assert step(handed_back(TxStatus.DISPATCHING), False) == dated
        assert step(later, True) is None  # a request left (answered 503, say)
        assert step(later, False) is not None
        dead = Decision(
            TxStatus.DEAD, error_class="http_503", dead_reason=DeadReason.RETRIES_EXHAUSTED
        )
        assert step(dead, False) is None  # terminal rows carry no date
        # a replay starts afresh, whatever date the row had
        db_conn.execute(
            "UPDATE transactions SET unsent_since = now() - interval '1 day' WHERE account_id = %s",
            (account,),
        )
        [dl] = [r[0] for r in db_conn.execute("SELECT id FROM dead_letters")]
        assert replay(conn, dl, key_trust_seconds=3600, by="test").result == "replayed"
        assert db_conn.execute(
            "SELECT status, unsent_since FROM transactions WHERE account_id = %s", (account,)
        ).fetchall() == [("unknown", None)]


def test_a_chunk_of_items_whose_token_is_refused_asks_for_a_token_once_per_pause(
    res: runtime.Runtime,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the pause, every item of a chunk asked for a token again at once: one holder
    sent about 400 token requests a second (2,061 in a 5 s drain of 200 items) for an account
    whose credentials the gateway refused."""
    monkeypatch.setenv("DRAIN_MAX_SECONDS", "2.5")
    monkeypatch.setenv("RETRY_BASE_DELAY", "0.05")  # retries due at once: the pause decides
    monkeypatch.setenv("HOLD_WAIT_MAX_SECONDS", "2.0")
    runtime.reset()
    rt = runtime.current()
    [batch] = submit_accounts(1, 200, "unsent-storm")
    account = batch["account_id"]
    gateway_sim.configure(secret="rotated")  # every token request: 401 invalid_client
    started = time.monotonic()
    drain.run_account(account, batch["batch_id"], rt)
    took = time.monotonic() - started
    asked = gateway_sim.statuses(account, "token")
    # at 0 s, after the 1 s pause and after the 2 s one: at most one per pause begun
    assert asked and set(asked) == {401}
    assert len(asked) <= 1 + int(took), (len(asked), took)
    assert gateway_sim.statuses(account, "payments") == []
    rows = db_conn.execute(
        "SELECT DISTINCT status, attempts, unsent_since IS NOT NULL, last_error_class"
        " FROM transactions WHERE account_id = %s",
        (account,),
    ).fetchall()
    assert {r[:3] for r in rows} == {("retryable", 0, True)}
    assert {r[3] for r in rows} <= {"http_401", "token_paused"}
