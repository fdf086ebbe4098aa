"""The producer publishes only after the commit (docs/producer.md, "Persist, then enqueue").

A broker that refuses costs nothing but latency (the batch waits ``pending`` for the
sweeper); a batch that was not saved is never published; and by the time the message is
published its rows are visible to any other connection, so a worker that takes the message
at once finds them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy.exc import SQLAlchemyError

from payment_worker import runtime, submit_batch
from payment_worker.worker import queueing
from payment_worker.worker.sweeper import run_sweep
from tests.conftest import ROOT, PwEnv
from tests.integration.test_producer import broker_messages, counts, make_batch

# the library call (not the CLI) in a process of its own: Celery fixes its broker at its
# first publish, so a refusing broker needs a fresh process
SUBMIT_CHILD = """
import json, sys, time
from prometheus_client import REGISTRY
from payment_worker import submit_batch
started = time.monotonic()
result = submit_batch(json.loads(sys.argv[1]))
print(json.dumps({
    "result": result.to_json(),
    "seconds": time.monotonic() - started,
    "enqueue_failures": REGISTRY.get_sample_value("payment_worker_enqueue_failures_total"),
}))
"""


def test_refusing_broker_batch_is_accepted_and_saved_pending(
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    closed_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**os.environ, "CELERY_BROKER_URL": f"redis://127.0.0.1:{closed_port}/0"}
    proc = subprocess.run(
        [sys.executable, "-c", SUBMIT_CHILD, json.dumps(make_batch("b-1", n=4))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["result"] == {"batch_id": "b-1", "status": "accepted", "items": 4, "errors": []}
    assert out["enqueue_failures"] == 1.0
    assert out["seconds"] < 5  # the publish fails fast, it does not stall the producer
    assert "Traceback" not in proc.stderr
    # saved whole, waiting for the sweeper; nothing reached the (working) broker
    assert counts(db_conn) == (1, 4, 4)
    assert db_conn.execute("SELECT status FROM batches").fetchall() == [("pending",)]
    statuses = db_conn.execute("SELECT DISTINCT status FROM transactions").fetchall()
    assert statuses == [("pending",)]
    assert broker_messages(pw_env) == []
    # ... and not lost: once stale, the sweeper enqueues it on the working broker
    monkeypatch.setenv("SWEEPER_STALE_AFTER", "1")
    runtime.reset()
    db_conn.execute("UPDATE transactions SET updated_at = now() - interval '1 minute'")
    assert run_sweep(runtime.current())["reenqueued"] == ["b-1"]
    assert broker_messages(pw_env) == ["b-1"]


def test_a_batch_whose_insert_failed_is_never_published(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], redis_client: redis.Redis
) -> None:
    # a real database error in the insert statement, on its last table: the test's own
    # database, so the trigger dies with it
    db_conn.execute(
        "CREATE FUNCTION pw_test_refuse() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'injected insert failure'; END $$"
    )
    db_conn.execute(
        "CREATE TRIGGER pw_test_refuse BEFORE INSERT ON idempotency_keys"
        " FOR EACH ROW EXECUTE FUNCTION pw_test_refuse()"
    )
    with pytest.raises(SQLAlchemyError, match="injected insert failure"):
        submit_batch(make_batch("b-1", n=3))
    assert broker_messages(pw_env) == []
    assert counts(db_conn) == (0, 0, 0)  # one statement: nothing of it is kept
    assert redis_client.keys("*") == []  # no dedup window for a batch never saved
    # the same batch, once the database takes it, is accepted and published once
    db_conn.execute("DROP TRIGGER pw_test_refuse ON idempotency_keys")
    assert submit_batch(make_batch("b-1", n=3)).status == "accepted"
    assert broker_messages(pw_env) == ["b-1"]


def test_rows_are_committed_when_the_publish_happens(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_enqueue = queueing.enqueue_batch
    seen: list[tuple[Any, ...]] = []

    def enqueue_and_look(batch_id: str, countdown: float | None = None, **kw: Any) -> None:
        # what a worker taking the message right now would find, from another connection
        with psycopg.connect(pw_env.database_url, autocommit=True) as other:
            row = other.execute(
                "SELECT b.status, count(t.id), count(k.key)"
                " FROM batches b LEFT JOIN transactions t ON t.batch_pk = b.id"
                " LEFT JOIN idempotency_keys k ON k.transaction_pk = t.id"
                " WHERE b.batch_id = %s GROUP BY b.status",
                (batch_id,),
            ).fetchone()
        seen.append((batch_id, row))
        real_enqueue(batch_id, countdown, **kw)

    # the producer imports enqueue_batch from queueing when it publishes
    monkeypatch.setattr(queueing, "enqueue_batch", enqueue_and_look)
    assert submit_batch(make_batch("b-1", n=5)).status == "accepted"
    assert seen == [("b-1", ("pending", 5, 5))]
    assert broker_messages(pw_env) == ["b-1"]
    # a duplicate publishes nothing, so it looks at nothing either
    assert submit_batch(make_batch("b-1", n=5)).status == "duplicate"
    assert len(seen) == 1 and broker_messages(pw_env) == ["b-1"]


def test_a_publish_waiting_for_a_broker_connection_gives_up_in_bounded_time(
    pw_env: PwEnv,
) -> None:
    """Every broker connection of the process is taken by a publish in progress (each
    retrying against a broker that does not answer): another publish gives up after
    ``PUBLISH_WAIT_SECONDS`` as "not published" instead of holding its slot, and perhaps
    its lock, without end (a review found no bound: kombu takes a producer's connection
    with none, whatever Celery's ``broker_pool_acquire_timeout``)."""
    import time

    held = [queueing._PUBLISH_SLOTS.acquire() for _ in range(10)]  # broker_pool_limit
    try:
        started = time.monotonic()
        with pytest.raises(queueing.PublishBusy):
            queueing.enqueue_batch("b-starved")
        waited = time.monotonic() - started
    finally:
        for slots in held:
            slots.release()
    assert queueing.PUBLISH_WAIT_SECONDS - 0.5 <= waited < queueing.PUBLISH_WAIT_SECONDS + 3
    queueing.enqueue_batch("b-fed")  # a connection free again: published at once
    assert broker_messages(pw_env) == ["b-fed"]
