"""submit_batch against real PostgreSQL and Redis: persist-then-enqueue and both dedup layers."""

from __future__ import annotations

import base64
import json
import threading
from typing import Any

import psycopg
import pytest
import redis
from prometheus_client import REGISTRY

from payment_worker import runtime, submit_batch
from payment_worker.db import batches as db
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.producer.submit import SubmitResult
from payment_worker.redis_keys import RedisKeys
from tests.conftest import PwEnv


def make_batch(
    batch_id: str, account: str = "acct-1", n: int = 3, *, tx: str = "tx"
) -> dict[str, Any]:
    return {
        "batch_id": batch_id,
        "account_id": account,
        "items": [
            {
                "transaction_id": f"{tx}-{i}",
                "amount": 1000 + i,
                "currency": "IDR",
                "beneficiary": {"bank_code": "014", "account_number": f"{i:010d}", "name": "Budi"},
                **({"description": f"item {i}"} if i % 2 else {}),
            }
            for i in range(n)
        ],
    }


def counts(conn: psycopg.Connection[Any]) -> tuple[int, int, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM batches), (SELECT count(*) FROM transactions),"
        " (SELECT count(*) FROM idempotency_keys)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def broker_messages(env: PwEnv) -> list[str]:
    """Batch ids of the messages waiting in the broker's ``payments`` queue, oldest first."""
    out = []
    # kombu LPUSHes and consumers BRPOP: the list's tail is the oldest message
    for raw in reversed(redis.Redis.from_url(env.broker_url).lrange("payments", 0, -1)):
        msg = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(msg["body"]))
        assert msg["headers"]["task"] == "payment_worker.process_account_batch"
        out.append(args[0])
    return out


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_accepted_batch_is_persisted_whole_then_enqueued(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    data = make_batch("b-1", n=4)
    result = submit_batch(data)
    assert result == SubmitResult("b-1", "accepted", 4, [])
    assert result.to_json() == {"batch_id": "b-1", "status": "accepted", "items": 4, "errors": []}

    assert counts(db_conn) == (1, 4, 4)
    batch = db_conn.execute(
        "SELECT account_id, status, item_count FROM batches WHERE batch_id = 'b-1'"
    ).fetchone()
    assert batch == ("acct-1", "pending", 4)
    rows = db_conn.execute(
        "SELECT t.transaction_id, t.amount, t.currency, t.beneficiary, t.description, t.status,"
        " t.idempotency_key, k.key, k.request_fingerprint, k.status"
        " FROM transactions t JOIN idempotency_keys k ON k.transaction_pk = t.id ORDER BY t.id"
    ).fetchall()
    # batch order is kept in the ids, and every stored identity is the one PaymentRequest makes
    assert [r[0] for r in rows] == ["tx-0", "tx-1", "tx-2", "tx-3"]
    for row, item in zip(rows, data["items"], strict=True):
        req = PaymentRequest(
            account_id="acct-1",
            transaction_id=item["transaction_id"],
            amount=item["amount"],
            currency=item["currency"],
            beneficiary=item["beneficiary"],
            description=item.get("description"),
        )
        assert row[1:6] == (req.amount, "IDR", req.beneficiary, req.description, "pending")
        assert row[6] == row[7] == req.idempotency_key
        assert row[8] == req.fingerprint()
        assert row[9] == "new"
    assert broker_messages(pw_env) == ["b-1"]


def test_resubmission_is_duplicate_and_enqueues_nothing(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], redis_client: redis.Redis
) -> None:
    data = make_batch("b-1")
    assert submit_batch(data).status == "accepted"
    before = metric("payment_worker_submit_duplicates_total", layer="redis")
    again = submit_batch(json.dumps(data))  # JSON text is accepted too
    assert again == SubmitResult("b-1", "duplicate", 3, [])
    assert metric("payment_worker_submit_duplicates_total", layer="redis") == before + 1

    # past the Redis window, Postgres still knows; reordered items are the same content
    redis_client.flushdb()
    before_pg = metric("payment_worker_submit_duplicates_total", layer="postgres")
    reordered = dict(data, items=list(reversed(data["items"])))
    assert submit_batch(reordered).status == "duplicate"
    assert metric("payment_worker_submit_duplicates_total", layer="postgres") == before_pg + 1
    # ... and that reopened the window
    assert redis_client.ttl(RedisKeys("pw").submit_dedup("b-1")) > 0

    assert counts(db_conn) == (1, 3, 3)
    assert broker_messages(pw_env) == ["b-1"]


def test_the_window_never_answers_duplicate_for_a_batch_postgres_lost(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], redis_client: redis.Redis
) -> None:
    """A failover that lost the last commits (asynchronous replication), or a restore: the
    batch is gone from Postgres, its window key is still in Redis. Before, a resubmission
    within the window was answered duplicate without asking Postgres, and never paid (a
    review found it; the runbook told operators to wait the window out). Now it is saved
    again, and enqueued."""
    data = make_batch("b-lost")
    assert submit_batch(data).status == "accepted"
    assert redis_client.exists(RedisKeys("pw").submit_dedup("b-lost"))
    # what the failover lost
    db_conn.execute(
        "DELETE FROM idempotency_keys WHERE transaction_pk IN (SELECT t.id FROM transactions t"
        " JOIN batches b ON b.id = t.batch_pk WHERE b.batch_id = 'b-lost')"
    )
    db_conn.execute(
        "DELETE FROM transactions WHERE batch_pk = (SELECT id FROM batches"
        " WHERE batch_id = 'b-lost')"
    )
    db_conn.execute("DELETE FROM batches WHERE batch_id = 'b-lost'")
    assert submit_batch(data).status == "accepted"
    assert counts(db_conn) == (1, 3, 3)
    assert broker_messages(pw_env) == ["b-lost", "b-lost"]


def test_same_batch_id_other_content_is_a_conflict(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    assert submit_batch(make_batch("b-1")).status == "accepted"
    changed = make_batch("b-1")
    changed["items"][1]["amount"] += 1
    # the Redis window holds the old fingerprint: it must not answer "duplicate" for this
    result = submit_batch(changed)
    assert result.status == "rejected"
    assert result.errors == [
        {"path": "$.batch_id", "message": "batch_id 'b-1' already exists with different content"}
    ]
    assert counts(db_conn) == (1, 3, 3)
    amounts = db_conn.execute("SELECT amount FROM transactions ORDER BY id").fetchall()
    assert [a for (a,) in amounts] == [1000, 1001, 1002]
    assert broker_messages(pw_env) == ["b-1"]


def test_transaction_in_another_batch_rejects_the_whole_new_batch(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    assert submit_batch(make_batch("b-1", n=3)).status == "accepted"
    overlap = make_batch("b-2", n=5)  # tx-0..tx-4: tx-0..tx-2 are b-1's
    result = submit_batch(overlap)
    assert result.status == "rejected" and result.items == 5
    assert result.errors == [
        {
            "path": f"$.items[{i}].transaction_id",
            "message": f"transaction_id 'tx-{i}' of account 'acct-1' already exists in batch 'b-1'",
        }
        for i in range(3)
    ]
    # nothing of b-2 is kept, not even its new items tx-3 and tx-4
    assert counts(db_conn) == (1, 3, 3)
    assert db_conn.execute("SELECT count(*) FROM batches WHERE batch_id = 'b-2'").fetchone() == (0,)
    # the same transaction ids under another account are other transactions
    assert submit_batch(make_batch("b-3", account="acct-2", n=3)).status == "accepted"
    assert broker_messages(pw_env) == ["b-1", "b-3"]


def test_invalid_batch_leaves_nothing_behind(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], redis_client: redis.Redis
) -> None:
    bad = make_batch("b-1", n=3)
    bad["items"][2]["amount"] = 12.5
    bad["items"][0]["currency"] = "idr"
    result = submit_batch(bad)
    assert result.status == "rejected"
    assert [e["path"] for e in result.errors] == ["$.items[0].currency", "$.items[2].amount"]
    assert submit_batch(b"{not json").errors[0]["path"] == "$"
    assert submit_batch("[1, 2]").errors == [
        {"path": "$", "message": "a batch must be a JSON object"}
    ]
    assert counts(db_conn) == (0, 0, 0)
    # nothing but the submission counts the exporter serves
    assert redis_client.keys("*") == [b"pw:submissions"]
    assert redis_client.hgetall("pw:submissions") == {b"rejected": b"3"}
    assert broker_messages(pw_env) == []


def test_enqueue_false_persists_and_leaves_it_to_the_sweeper(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    assert submit_batch(make_batch("b-1"), enqueue=False).status == "accepted"
    assert submit_batch(make_batch("b-2", tx="other"), enqueue=False).status == "accepted"
    assert broker_messages(pw_env) == []
    with runtime.current().engine.connect() as conn:
        assert db.pending_batch_ids(conn) == ["b-1", "b-2"]
        assert db.pending_batch_ids(conn, limit=1) == ["b-1"]
    db_conn.execute("UPDATE batches SET status = 'completed' WHERE batch_id = 'b-1'")
    with runtime.current().engine.connect() as conn:
        assert db.pending_batch_ids(conn) == ["b-2"]


def test_unreachable_redis_only_costs_the_fast_path(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    dead = pw_env.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    rt = runtime.Runtime(dead)
    try:
        assert submit_batch(make_batch("b-1"), runtime=rt, enqueue=False).status == "accepted"
        assert submit_batch(make_batch("b-1"), runtime=rt, enqueue=False).status == "duplicate"
    finally:
        rt.close()
    assert counts(db_conn) == (1, 3, 3)


def test_racing_threads_one_accepted_rest_duplicate(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """The database decides: identical batches raced from 8 threads."""
    data = make_batch("b-race", n=50)
    start = threading.Barrier(8)
    results: list[str] = []

    def run() -> None:
        start.wait()
        results.append(submit_batch(data).status)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["accepted"] + ["duplicate"] * 7
    assert counts(db_conn) == (1, 50, 50)
    assert broker_messages(pw_env) == ["b-race"]


def test_overlapping_batches_raced_in_opposite_orders(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two batches sharing transactions in opposite orders: one wins whole, one is rejected,
    each in one statement. They used to deadlock, and on a loaded host the retried loser
    could meet the winner again three times and raise; the per-account submission lock
    makes the second wait for the first instead."""
    a = make_batch("b-a", n=3000)
    b = make_batch("b-b", n=3000)
    b["items"].reverse()
    start = threading.Barrier(2)
    results: dict[str, SubmitResult] = {}
    raised: list[BaseException] = []
    statements: list[str] = []
    insert_once = db._insert_once

    def counted(engine: Any, batch: Any, **kw: Any) -> Any:
        statements.append(batch.batch_id)
        return insert_once(engine, batch, **kw)

    monkeypatch.setattr(db, "_insert_once", counted)

    def run(data: dict[str, Any]) -> None:
        start.wait()
        try:
            results[data["batch_id"]] = submit_batch(data, enqueue=False)
        except BaseException as exc:  # surfaced below: a thread's exception is otherwise lost
            raised.append(exc)

    threads = [threading.Thread(target=run, args=(d,)) for d in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert raised == []
    statuses = sorted(r.status for r in results.values())
    assert statuses == ["accepted", "rejected"]
    assert sorted(statements) == ["b-a", "b-b"]  # no deadlock, so no statement run twice
    loser = next(r for r in results.values() if r.status == "rejected")
    assert len(loser.errors) == 3000
    assert counts(db_conn) == (1, 3000, 3000)


@pytest.mark.parametrize("n", [1, 10_000])
def test_batch_size_limits_round_trip(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], n: int
) -> None:
    assert submit_batch(make_batch("b-n", n=n), enqueue=False).items == n
    assert counts(db_conn) == (1, n, n)


def test_a_unique_violation_that_is_not_a_clash_is_a_database_error(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """A restore that left the transactions' identity behind the table: the next insert
    trips the primary key, which no other batch's transaction explains. Before, it was
    taken for a clash whose owner could not be found, tried three times and raised a bare
    RuntimeError (a traceback from the CLI; a review found it). Now it is the database
    error it is, and nothing is saved."""
    from sqlalchemy.exc import IntegrityError

    assert submit_batch(make_batch("b-1")).status == "accepted"
    db_conn.execute("ALTER TABLE transactions ALTER COLUMN id RESTART WITH 1")
    with pytest.raises(IntegrityError, match="transactions_pkey"):
        submit_batch(make_batch("b-2", tx="other"))
    assert counts(db_conn) == (1, 3, 3)
