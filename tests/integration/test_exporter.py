"""The exporter process serves gauges read from the test's own Postgres, Redis and broker:
state by status, in-doubt and pending ages, open dead letters by reason, accounts waiting,
queue depth (waiting and delayed), workers alive and the producers' submission counts;
reads are cached (one round per EXPORTER_CACHE_SECONDS)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, event

from payment_worker import runtime
from payment_worker.db import reports
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.domain.statuses import TxStatus
from payment_worker.ops.exporter import Sources, StateCollector
from payment_worker.worker.queueing import enqueue_batch
from tests.conftest import PwEnv, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _args(port: int) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(port)]


def _seed(conn: psycopg.Connection[Any]) -> None:
    """Two batches; transactions in five states, one open for an hour, one in doubt for 20
    minutes, one retried in vain for 25 minutes (and a terminal one whose date is ignored);
    one open dead letter and one resolved."""
    # a completed batch keeps its counts (written by its completion): the terminal totals
    conn.execute(
        "INSERT INTO batches (batch_id, account_id, fingerprint, status, item_count,"
        " succeeded_count, failed_count)"
        " VALUES ('b1', 'acct-1', 'f1', 'processing', 5, 0, 0),"
        " ('b2', 'acct-2', 'f2', 'completed', 2, 1, 1)"
    )
    rows = [
        ("b1", "acct-1", "t1", "pending", "1 hour"),
        ("b1", "acct-1", "t2", "pending", "0 seconds"),
        ("b1", "acct-1", "t3", "unknown", "30 minutes"),
        ("b1", "acct-1", "t4", "dead", "2 hours"),  # older, but terminal: not counted as open
        ("b1", "acct-1", "t5", "retryable", "1 minute"),
        ("b2", "acct-2", "t1", "succeeded", "3 hours"),
        ("b2", "acct-2", "t2", "failed", "3 hours"),
    ]
    for batch, account, tx, status, age in rows:
        conn.execute(
            "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,"
            " beneficiary, idempotency_key, status, created_at)"
            " SELECT id, %s, %s, 100, 'EUR', '{}'::jsonb, %s, %s, now() - %s::interval"
            " FROM batches WHERE batch_id = %s",
            (account, tx, f"{account}:{tx}", status, age, batch),
        )
    conn.execute(
        "UPDATE transactions SET doubt_since = now() - interval '20 minutes'"
        " WHERE transaction_id = 't3'"
    )
    conn.execute(
        "UPDATE transactions SET unsent_since = now() - CASE transaction_id"
        " WHEN 't5' THEN interval '25 minutes' ELSE interval '2 hours' END"
        " WHERE transaction_id IN ('t4', 't5') AND account_id = 'acct-1'"
    )
    conn.execute(
        "INSERT INTO dead_letters (transaction_pk, reason, resolved_at)"
        " SELECT id, 'retries_exhausted', NULL FROM transactions WHERE transaction_id = 't4'"
    )
    conn.execute(
        "INSERT INTO dead_letters (batch_pk, reason, resolved_at)"
        " SELECT id, 'task_crashed', now() FROM batches WHERE batch_id = 'b2'"
    )


def start_exporter(port: int, cache_seconds: float = 0) -> subprocess.Popen[str]:
    """``payment-worker exporter`` as a real process (environment: the test's databases)."""
    env = {**os.environ, "EXPORTER_CACHE_SECONDS": str(cache_seconds)}
    return subprocess.Popen(
        [sys.executable, "-m", "payment_worker.cli", "exporter", *_args(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def exporter(pw_env: object) -> Iterator[str]:
    """A running ``payment-worker exporter`` against the test's database; its /metrics URL."""
    port = _free_port()
    proc = start_exporter(port)
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "exporter did not listen"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_exporter_serves_state_from_postgres(
    exporter: str, db_conn: psycopg.Connection[Any]
) -> None:
    before = _samples(httpx.get(exporter, timeout=10).text)
    assert before[("payment_worker_exporter_up", ())] == 1, before
    for source in ("postgres", "postgres_totals", "redis", "broker", "workers"):
        assert before[("payment_worker_exporter_source_up", (("source", source),))] == 1
    assert before[("payment_worker_transactions", (("status", "pending"),))] == 0
    assert before[("payment_worker_oldest_open_transaction_age_seconds", ())] == 0

    _seed(db_conn)
    resp = httpx.get(exporter, timeout=10)
    assert resp.status_code == 200
    m = _samples(resp.text)
    tx = {status: m[("payment_worker_transactions", (("status", status),))] for status in TxStatus}
    expected = {"pending": 2, "dispatching": 0, "retryable": 1, "unknown": 1}
    assert tx == {**expected, "succeeded": 1, "failed": 1, "dead": 1}
    assert m[("payment_worker_batches", (("status", "processing"),))] == 1
    assert m[("payment_worker_batches", (("status", "completed"),))] == 1
    assert m[("payment_worker_batches", (("status", "pending"),))] == 0
    assert m[("payment_worker_dead_letters_open", (("reason", "retries_exhausted"),))] == 1
    assert m[("payment_worker_dead_letters_open", (("reason", "task_crashed"),))] == 0
    assert m[("payment_worker_oldest_open_dead_letter_age_seconds", ())] >= 0
    assert m[("payment_worker_in_doubt_transactions", ())] == 1
    # the in-doubt clock is doubt_since (20 min), not the item's age (30 min)
    assert 1200 <= m[("payment_worker_oldest_in_doubt_age_seconds", ())] < 1300
    assert 3600 <= m[("payment_worker_oldest_pending_age_seconds", ())] < 3700
    assert m[("payment_worker_accounts_waiting", ())] == 1  # acct-2 has nothing open
    # retried in vain: the open t5 (25 min); the dead t4's two hours are not counted
    assert 1500 <= m[("payment_worker_oldest_unsent_age_seconds", ())] < 1600
    assert m[("payment_worker_accounts_unsent", ())] == 1
    assert (
        m[("payment_worker_dead_letters_replayed_total", (("reason", "retries_exhausted"),))] == 0
    )
    assert m[("payment_worker_dead_letters_resolved_total", (("reason", "task_crashed"),))] == 1
    # the oldest open one is an hour old; the two-hour-old one is terminal (dead)
    assert 3600 <= m[("payment_worker_oldest_open_transaction_age_seconds", ())] < 3700
    assert m[("payment_worker_exporter_scrape_duration_seconds", ())] > 0

    # read per scrape: a change in Postgres shows up in the next scrape (b1's open items
    # succeed: counted from the open batch's items, b2's from its counts)
    db_conn.execute(
        "UPDATE transactions SET status = 'succeeded'"
        " WHERE status NOT IN ('succeeded', 'failed', 'dead')"
    )
    after = _samples(httpx.get(exporter, timeout=10).text)
    assert after[("payment_worker_transactions", (("status", "succeeded"),))] == 5
    assert after[("payment_worker_oldest_open_transaction_age_seconds", ())] == 0
    assert after[("payment_worker_accounts_waiting", ())] == 0
    assert after[("payment_worker_in_doubt_transactions", ())] == 0
    assert after[("payment_worker_oldest_in_doubt_age_seconds", ())] == 0
    assert after[("payment_worker_oldest_unsent_age_seconds", ())] == 0
    assert after[("payment_worker_accounts_unsent", ())] == 0


def _sources(db_url: str, pw_env: PwEnv) -> Sources:
    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    rt = runtime.current()
    return Sources(engine, rt.redis, redis.Redis.from_url(pw_env.broker_url), rt.keys)


def _collect_once(sources: Sources) -> tuple[dict[str, Any], float, dict[str, float]]:
    """One collection (the engine disposed after): the families by name, the overall up
    gauge, and the up gauge of each source."""
    try:
        families = {f.name: f for f in StateCollector(sources).collect()}
    finally:
        sources.engine.dispose()
    (up,) = [s.value for s in families["payment_worker_exporter_up"].samples]
    ups = {
        s.labels["source"]: s.value for s in families["payment_worker_exporter_source_up"].samples
    }
    return families, up, ups


def test_unreachable_database_reports_up_zero_not_an_error(pw_env: PwEnv) -> None:
    # a real fault: the database does not exist
    url = urlunsplit(urlsplit(pw_env.database_url)._replace(path="/no_such_database_pw"))
    families, up, ups = _collect_once(_sources(url, pw_env))
    assert up == 0
    assert ups == {"postgres": 0, "postgres_totals": 0, "redis": 1, "broker": 1}
    # what could be read is still served; nothing of Postgres is
    assert "payment_worker_queue_messages" in families
    assert "payment_worker_transactions" not in families


def test_a_broker_that_is_not_redis_serves_everything_but_queue_depths(pw_env: PwEnv) -> None:
    # the runtime has no broker client for, say, RabbitMQ (Runtime.broker_redis is None):
    # the exporter serves the rest and says nothing of a source it cannot read
    sources = _sources(pw_env.database_url, pw_env)
    families, up, ups = _collect_once(
        Sources(sources.engine, sources.app_redis, None, sources.keys)
    )
    assert up == 1
    assert ups == {"postgres": 1, "postgres_totals": 1, "redis": 1}
    assert "payment_worker_queue_messages" not in families
    assert "payment_worker_transactions" in families


def test_totals_that_run_out_of_time_leave_every_alerting_gauge_read(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big database whose totals (terminal transactions, batches) take longer than the
    statement timeout: before, every Postgres series went with them, and with them the
    in-doubt, stalled and dead-letter alerts (a review found it). Now the totals are their
    own source, read last in a savepoint. The slow read is real: the batches table is held
    by another session's lock, which only the totals read."""
    from payment_worker.ops import exporter as exporter_module

    _seed(db_conn)
    monkeypatch.setattr(exporter_module, "_STATEMENT_TIMEOUT_MS", 500)
    with psycopg.connect(pw_env.database_url) as holder:
        holder.execute("LOCK TABLE batches IN ACCESS EXCLUSIVE MODE")
        families, up, ups = _collect_once(_sources(pw_env.database_url, pw_env))
    assert up == 1  # every alerting gauge was read: not a PaymentExporterDown
    assert ups == {"postgres": 1, "postgres_totals": 0, "redis": 1, "broker": 1}
    tx = {s.labels["status"]: s.value for s in families["payment_worker_transactions"].samples}
    # the open statuses only: a terminal one unread is a gap, never a 0
    assert tx == {"pending": 2, "dispatching": 0, "retryable": 1, "unknown": 1}
    assert "payment_worker_batches" not in families
    (in_doubt,) = families["payment_worker_in_doubt_transactions"].samples
    assert in_doubt.value == 1
    assert "payment_worker_dead_letters_open" in families


def test_reads_are_cached_one_round_per_period(pw_env: PwEnv, db_conn: Any) -> None:
    sources = _sources(pw_env.database_url, pw_env)
    statements: list[str] = []
    event.listen(sources.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    collector = StateCollector(sources, cache_seconds=1.5)

    def pending() -> float:
        for f in collector.collect():
            if f.name == "payment_worker_transactions":
                return next(s.value for s in f.samples if s.labels["status"] == "pending")
        raise AssertionError("no payment_worker_transactions")

    try:
        assert pending() == 0
        one_round = len(statements)
        assert one_round > 0
        _seed(db_conn)
        # scrapes within the period get the same figures and cost no query
        for _ in range(5):
            assert pending() == 0
        assert len(statements) == one_round
        time.sleep(1.6)
        assert pending() == 2
        assert len(statements) == 2 * one_round
    finally:
        sources.engine.dispose()


def test_queue_depth_workers_alive_and_submissions(
    pw_env: PwEnv, tmp_path: Any, db_conn: Any
) -> None:
    port = _free_port()
    proc = start_exporter(port)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_until(lambda: _up(url), 30, "the exporter")
        m = _samples(httpx.get(url, timeout=10).text)
        for q in ("payments", "dlq", "delayed"):
            assert m[("payment_worker_queue_messages", (("queue", q),))] == 0
        assert m[("payment_worker_workers_alive", ())] == 0
        for result in ("accepted", "duplicate", "rejected"):
            assert m[("payment_worker_submissions_total", (("result", result),))] == 0

        # three messages waiting with no worker; one on the dlq queue
        for n in range(3):
            enqueue_batch(f"no-such-batch-{n}")
        runtime.current()  # the app is configured for the test's broker
        from payment_worker.worker.celery_app import app

        app.send_task("payment_worker.dlq.record_crash", kwargs={}, queue="dlq")
        m = _samples(httpx.get(url, timeout=10).text)
        assert m[("payment_worker_queue_messages", (("queue", "payments"),))] == 3
        assert m[("payment_worker_queue_messages", (("queue", "dlq"),))] == 1

        # the producer's counts, from a short `payment-worker submit` process
        batch = {
            "batch_id": "exp-1",
            "account_id": "acct-x",
            "items": [
                {
                    "transaction_id": "t-1",
                    "amount": 100,
                    "currency": "IDR",
                    "beneficiary": {"bank_code": "014", "account_number": "1", "name": "A"},
                }
            ],
        }
        path = tmp_path / "b.json"
        path.write_text(json.dumps([batch, batch, {"batch_id": "bad"}]))
        sub = subprocess.run(
            [sys.executable, "-m", "payment_worker.cli", "submit", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert [json.loads(line)["status"] for line in sub.stdout.splitlines()] == [
            "accepted",
            "duplicate",
            "rejected",
        ], sub.stderr

        # a real worker: it takes the messages, answers the ping, and holds a delayed one
        db_conn.execute("SELECT 1")
        with LocalCluster(
            workdir=tmp_path / "cluster", env={**os.environ, "METRICS_PORT": "0"}
        ) as c:
            c.start_worker(concurrency=2)
            enqueue_batch("delayed-batch", countdown=120)

            def settled() -> bool:
                m = _samples(httpx.get(url, timeout=10).text)
                return (
                    m[("payment_worker_workers_alive", ())] == 1
                    and m[("payment_worker_queue_messages", (("queue", "delayed"),))] == 1
                    and m[("payment_worker_queue_messages", (("queue", "payments"),))] == 0
                )

            wait_until(settled, 60, "one worker alive, one delayed message, payments drained")
        m = _samples(httpx.get(url, timeout=10).text)
        assert m[("payment_worker_submissions_total", (("result", "accepted"),))] == 1
        assert m[("payment_worker_submissions_total", (("result", "duplicate"),))] == 1
        assert m[("payment_worker_submissions_total", (("result", "rejected"),))] == 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_an_item_left_dispatching_is_in_doubt_one_in_flight_is_not(
    pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """A ``dispatching`` item claimed half an hour ago had its sender die with it on the wire:
    maybe paid, counted and dated as in doubt (the in-doubt alert's gauge once counted
    ``unknown`` only), and so is a resend of one in doubt for 40 minutes. One claimed a
    moment ago, or two minutes ago and never in doubt, is on its way."""
    db_conn.execute(
        "INSERT INTO batches (batch_id, account_id, fingerprint, status, item_count)"
        " VALUES ('b1', 'acct-1', 'f1', 'processing', 3)"
    )
    for tx, dispatched, doubt in (
        ("left", "30 minutes", None),  # first send, its sender gone
        ("resent", "2 minutes", "40 minutes"),  # a resend after a 404: the first send's clock
        ("in-flight", "0 seconds", None),
    ):
        db_conn.execute(
            "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,"
            " beneficiary, idempotency_key, status, created_at, dispatched_at, doubt_since)"
            " SELECT id, 'acct-1', %s, 100, 'EUR', '{}'::jsonb, %s, 'dispatching',"
            " now() - interval '1 hour', now() - %s::interval, now() - %s::interval"
            " FROM batches WHERE batch_id = 'b1'",
            (tx, f"acct-1:{tx}", dispatched, doubt),
        )
    # replayed a moment ago, never in doubt: unknown (looked up first), its last claim hours
    # old; dated by its replay, not by that claim
    db_conn.execute(
        "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,"
        " beneficiary, idempotency_key, status, created_at, dispatched_at)"
        " SELECT id, 'acct-1', 'replayed', 100, 'EUR', '{}'::jsonb, 'acct-1:replayed',"
        " 'unknown', now() - interval '5 hours', now() - interval '3 hours'"
        " FROM batches WHERE batch_id = 'b1'"
    )
    with runtime.current().engine.connect() as conn:
        state = reports.state_snapshot(conn, statement_timeout_ms=5_000)
    assert state.in_doubt == 3
    assert 2400 <= state.oldest_in_doubt_age < 2500
    db_conn.execute("UPDATE transactions SET doubt_since = NULL")
    with runtime.current().engine.connect() as conn:
        state = reports.state_snapshot(conn, statement_timeout_ms=5_000)
    assert state.in_doubt == 2
    assert 1800 <= state.oldest_in_doubt_age < 1900
