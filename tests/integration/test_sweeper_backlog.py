"""The sweeper behind a large backlog (issue 13), against real PostgreSQL and Redis.

Its first query reads every due open item once a pass. So it names each account's oldest
batch with due work, it runs on one Postgres backend (no parallel plan taking every core
of the database host from the drains), and a pass that outgrows the interval keeps the
fleet's next pass away for as long as it took itself. Rows are aged with an UPDATE of
``updated_at``, not by sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from payment_worker import runtime
from payment_worker.db import stalls
from payment_worker.worker import sweeper
from payment_worker.worker.sweeper import sweep_if_due
from tests.conftest import PwEnv
from tests.integration.test_sweeper import _save

pytestmark = pytest.mark.integration

INTERVAL = 0.5  # SWEEPER_INTERVAL here: the interval's own gap between passes is 400 ms


@pytest.fixture
def fast_rt(pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[runtime.Runtime]:
    monkeypatch.setenv("SWEEPER_INTERVAL", str(INTERVAL))
    runtime.reset()
    rt = runtime.current()
    assert rt.settings.sweeper_interval == INTERVAL
    yield rt
    runtime.reset()


def _backlog(db: psycopg.Connection[Any], accounts: int, items_each: int) -> None:
    """A backlog written moments ago (so no account is stale): ``accounts`` batches of
    ``items_each`` pending items."""
    db.execute(
        """
        INSERT INTO batches (batch_id, account_id, fingerprint, item_count)
        SELECT 'bk-' || a, 'bk-acct-' || a, 'f', %(n)s FROM generate_series(1, %(a)s) a
        """,
        {"a": accounts, "n": items_each},
    )
    db.execute(
        """
        INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,
                                  beneficiary, idempotency_key)
        SELECT b.id, b.account_id, 'tx-' || i, 100, 'EUR', '{}'::jsonb,
               b.account_id || '.tx-' || i
        FROM batches b, generate_series(1, %(n)s) i WHERE b.batch_id LIKE 'bk-%%'
        """,
        {"n": items_each},
    )
    db.execute("ANALYZE transactions")


def test_the_oldest_batch_with_due_work_is_named_and_doubt_is_seen(
    rt: runtime.Runtime, db_conn: psycopg.Connection[Any]
) -> None:
    # acct-1: "b-z" saved first, "b-a" second: the older batch is named, not the first name
    _save("b-z", "acct-1", rt)
    _save("b-a", "acct-1", rt)
    _save("b-2", "acct-2", rt)
    db_conn.execute("UPDATE transactions SET updated_at = now() - interval '1 minute'")
    # acct-2's items became due earlier: the oldest due work comes first
    db_conn.execute(
        "UPDATE transactions SET next_attempt_at = now() - interval '1 hour',"
        " status = 'unknown' WHERE account_id = 'acct-2'"
    )
    with rt.engine.connect() as conn:
        found = stalls.stalled_accounts(conn, 2.0)
    assert [(a.account_id, a.batch_id, a.in_doubt, a.stale) for a in found] == [
        ("acct-2", "b-2", True, True),
        ("acct-1", "b-z", False, True),
    ]
    # b-z's items are done: b-a is now acct-1's oldest batch with due work
    db_conn.execute(
        "UPDATE transactions t SET status = 'succeeded' FROM batches b"
        " WHERE b.id = t.batch_pk AND b.batch_id = 'b-z'"
    )
    with rt.engine.connect() as conn:
        found = stalls.stalled_accounts(conn, 2.0)
        # fresh writes make an account not stale; `every` still lists it
        db_conn.execute("UPDATE transactions SET updated_at = now() WHERE account_id = 'acct-2'")
        every = stalls.stalled_accounts(conn, 2.0, every=True)
    assert [(a.account_id, a.batch_id) for a in found] == [("acct-2", "b-2"), ("acct-1", "b-a")]
    # (the stale ones first: the limit must not leave out an account that needs a repair)
    assert [(a.account_id, a.stale) for a in every] == [("acct-1", True), ("acct-2", False)]


def test_the_query_runs_on_one_backend_for_its_transaction_only(rt: runtime.Runtime) -> None:
    with rt.engine.connect() as conn:
        default = conn.exec_driver_sql("SHOW max_parallel_workers_per_gather").scalar()
        assert default != "0"
        conn.rollback()
        stalls.stalled_accounts(conn, 2.0)
        assert conn.exec_driver_sql("SHOW max_parallel_workers_per_gather").scalar() == "0"
        conn.rollback()
        # SET LOCAL: nothing is left on the pooled (or a PgBouncer) connection
        assert conn.exec_driver_sql("SHOW max_parallel_workers_per_gather").scalar() == default


def _passes() -> tuple[float, float]:
    count = REGISTRY.get_sample_value("payment_worker_sweep_seconds_count") or 0.0
    total = REGISTRY.get_sample_value("payment_worker_sweep_seconds_sum") or 0.0
    return count, total


def test_a_pass_longer_than_the_interval_keeps_the_next_one_away_as_long(
    fast_rt: runtime.Runtime, db_conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    tick = fast_rt.keys.sweeper_tick()
    # nothing due: a short pass leaves the interval's own gap
    before = _passes()
    assert sweep_if_due(fast_rt)["result"] == "ok"
    assert 0 < fast_rt.redis.pttl(tick) <= INTERVAL * 800
    first = _passes()
    assert first[0] == before[0] + 1
    fast_rt.redis.delete(tick)
    # a backlog of 60,000 due items: the pass reads each of them (tens of ms on a fast host,
    # more here), longer than a 5 ms interval's 4 ms gap on any host
    interval = 0.005
    monkeypatch.setattr(fast_rt.settings, "sweeper_interval", interval)
    _backlog(db_conn, accounts=3000, items_each=20)
    rests: list[float] = []  # the length each pass asked to rest for, in seconds
    rest_after = sweeper._rest_after

    def recorded(res: runtime.Runtime, seconds: float) -> None:
        rests.append(seconds)
        rest_after(res, seconds)

    monkeypatch.setattr(sweeper, "_rest_after", recorded)
    started = time.monotonic()
    assert sweep_if_due(fast_rt)["result"] == "ok"
    took_ms = (time.monotonic() - started) * 1000
    left_ms = fast_rt.redis.pttl(tick)
    count, total = _passes()
    assert count == first[0] + 1
    pass_ms = (total - first[1]) * 1000  # the histogram's own measure of this pass
    assert took_ms > interval * 800, f"the pass took {took_ms:.1f} ms: make the backlog larger"
    # the rest asked for is at least the pass's own length (what the clocks around the tick
    # key read, a GIL hand-off between the key's write and its read included, is not)
    assert len(rests) == 1 and rests[0] * 1000 >= pass_ms
    # and the tick key holds it: set when the pass ended, for as long as it took
    assert interval * 800 < left_ms <= int(rests[0] * 1000) <= took_ms
    assert sweep_if_due(fast_rt) == {"result": "not_due"}
