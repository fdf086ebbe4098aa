"""The exporter process serves gauges read from the test's own Postgres database."""

from __future__ import annotations

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
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine

from payment_worker.domain.statuses import TxStatus
from payment_worker.ops.exporter import PostgresStateCollector


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
    """Two batches; transactions in five states, one open for an hour; one open dead letter."""
    conn.execute(
        "INSERT INTO batches (batch_id, account_id, fingerprint, status, item_count)"
        " VALUES ('b1', 'acct-1', 'f1', 'processing', 5), ('b2', 'acct-2', 'f2', 'completed', 2)"
    )
    rows = [
        ("b1", "acct-1", "t1", "pending", "1 hour"),
        ("b1", "acct-1", "t2", "pending", "0 seconds"),
        ("b1", "acct-1", "t3", "unknown", "10 minutes"),
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
        "INSERT INTO dead_letters (transaction_pk, reason, resolved_at)"
        " SELECT id, 'retries exhausted', NULL FROM transactions WHERE transaction_id = 't4'"
    )
    conn.execute(
        "INSERT INTO dead_letters (batch_pk, reason, resolved_at)"
        " SELECT id, 'old', now() FROM batches WHERE batch_id = 'b2'"
    )


@pytest.fixture
def exporter(pw_env: object) -> Iterator[str]:
    """A running ``payment-worker exporter`` against the test's database; its /metrics URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "payment_worker.cli", "exporter", *_args(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    assert before[("payment_worker_exporter_up", ())] == 1
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
    assert m[("payment_worker_dead_letters_open", ())] == 1
    assert m[("payment_worker_oldest_open_dead_letter_age_seconds", ())] >= 0
    assert m[("payment_worker_dead_letters_replayed_total", (("reason", "retries_exhausted"),))] == 0
    assert m[("payment_worker_dead_letters_resolved_total", (("reason", "task_crashed"),))] == 0
    # the oldest open one is an hour old; the two-hour-old one is terminal (dead)
    assert 3600 <= m[("payment_worker_oldest_open_transaction_age_seconds", ())] < 3700
    assert m[("payment_worker_exporter_scrape_duration_seconds", ())] > 0

    # read per scrape: a change in Postgres shows up in the next scrape
    db_conn.execute("UPDATE transactions SET status = 'succeeded' WHERE status <> 'dead'")
    after = _samples(httpx.get(exporter, timeout=10).text)
    assert after[("payment_worker_transactions", (("status", "succeeded"),))] == 6
    assert after[("payment_worker_oldest_open_transaction_age_seconds", ())] == 0


def test_unreachable_database_reports_up_zero_not_an_error(pw_env: Any) -> None:
    # a real fault: the database does not exist
    url = urlunsplit(urlsplit(pw_env.database_url)._replace(path="/no_such_database_pw"))
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        families = list(PostgresStateCollector(engine).collect())
    finally:
        engine.dispose()
    assert [(f.name, [s.value for s in f.samples]) for f in families] == [("payment_worker_exporter_up", [0])]
