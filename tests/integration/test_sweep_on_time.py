"""The sweep runs on time under a backlog: real Celery workers, Postgres, Redis, simulator.

Every worker process sweeps from its own thread (worker/lifecycle.py, worker/sweeper.py), so
the repair path needs neither a place in the ``payments`` queue nor a free task slot. Here
the queue holds a backlog, every slot of the worker is busy with a slow gateway, no beat
runs, and an account whose message was lost must still be re-enqueued within a few
``SWEEPER_INTERVAL``s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from prometheus_client import REGISTRY

from payment_worker import runtime
from payment_worker.db.retry import REASONS
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from payment_worker.worker.queueing import enqueue_batch
from payment_worker.worker.sweeper import SweeperThread, sweep_if_due
from tests.conftest import PwEnv, ServiceUrls, _with_db, wait_until
from tests.db_watch import terminate_backends
from tests.integration.test_producer import make_batch

DB_RETRIES_TOTAL = "payment_worker_db_retries_total"
INTERVAL = 0.5  # SWEEPER_INTERVAL of these tests, seconds
SLOTS = 2


@pytest.fixture
def srt(pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch) -> runtime.Runtime:
    monkeypatch.setenv("SWEEPER_INTERVAL", str(INTERVAL))
    monkeypatch.setenv("SWEEPER_STALE_AFTER", "1")
    runtime.reset()
    return runtime.current()


def test_one_pass_per_interval_however_many_processes_tick(srt: runtime.Runtime) -> None:
    assert sweep_if_due(srt)["result"] == "ok"
    # every other process ticking within the interval finds it taken
    assert [sweep_if_due(srt)["result"] for _ in range(5)] == ["not_due"] * 5
    time.sleep(INTERVAL)
    assert sweep_if_due(srt)["result"] == "ok"


def test_the_thread_sweeps_every_interval_and_stops_at_once(srt: runtime.Runtime) -> None:
    thread = SweeperThread(runtime.current, INTERVAL)
    thread.start()
    try:
        wait_until(lambda: thread.passes >= 3, 6 * INTERVAL, "three passes")
    finally:
        t0 = time.monotonic()
        thread.stop(5)
    assert not thread.is_alive() and time.monotonic() - t0 < 1.0


def _db_retries() -> float:
    return sum(REGISTRY.get_sample_value(DB_RETRIES_TOTAL, {"reason": r}) or 0.0 for r in REASONS)


def test_a_killed_connection_costs_the_thread_a_counted_retry(
    srt: runtime.Runtime, service_urls: ServiceUrls
) -> None:
    assert sweep_if_due(srt)["result"] == "ok"  # the pool now holds a connection
    time.sleep(INTERVAL)  # the next pass is due
    # a server restart as the sweeper meets it: its pooled connections are dead
    assert terminate_backends(_with_db(service_urls.pg_admin, "postgres"), os.getpid()) >= 1
    before = _db_retries()
    thread = SweeperThread(runtime.current, INTERVAL)
    thread.start()
    try:
        # the failed tick is counted like a drain's retry, and the next one sweeps
        wait_until(lambda: _db_retries() > before, 6 * INTERVAL, "the retry counted")
        wait_until(lambda: thread.passes >= 1, 6 * INTERVAL, "a pass after the blip")
    finally:
        thread.stop(5)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_sweep_happens_with_the_queue_full_and_every_slot_busy(
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pool: str,
) -> None:
    env = {
        **os.environ,
        "METRICS_PORT": "0",
        "SWEEPER_INTERVAL": str(INTERVAL),
        "SWEEPER_STALE_AFTER": "1",
        # a task holds its account for a short slice, then hands it back to the queue
        "DRAIN_MAX_SECONDS": "2",
    }
    app_redis = redis.Redis.from_url(pw_env.redis_url)
    broker = redis.Redis.from_url(pw_env.broker_url)
    with LocalCluster(workdir=tmp_path, env=env, concurrency=SLOTS, pool=pool) as cluster:
        cluster.start_simulator()
        cluster.configure_simulator(latency_ms=1000)  # every payment takes a second
        monkeypatch.setenv("GATEWAY_URL", cluster.env["GATEWAY_URL"])
        runtime.reset()
        # the backlog: ten accounts of slow work, and many more messages queued behind it
        batches = make_batches(batches=10, items=20, accounts=10, prefix="busy")
        for b in batches:
            assert submit_batch(b).status == "accepted"
        for _ in range(5):
            for b in batches:
                enqueue_batch(b["batch_id"])
        # the victim: accepted while the broker was down, no message anywhere
        victim = make_batch("victim", account="acct-victim", n=2, tx="victim")
        assert submit_batch(victim, enqueue=False).status == "accepted"
        worker = cluster.start_worker()

        def busy() -> bool:
            held = len(app_redis.keys("pw:lock:{acct-*}"))
            return held == SLOTS and broker.llen("payments") > 20

        wait_until(busy, 60, "every slot busy with the queue still full")
        # the victim's items now look untouched for a minute: stalled
        db_conn.execute(
            "UPDATE transactions SET updated_at = now() - interval '1 minute'"
            " WHERE account_id = 'acct-victim'"
        )
        t0 = time.monotonic()
        swept = "pw:swept:{acct-victim}"
        wait_until(lambda: bool(app_redis.exists(swept)), 6 * INTERVAL, "the victim swept")
        took = time.monotonic() - t0
        # it did not wait for the backlog: still every slot busy, still a full queue (within
        # a moment: a task handing its account back leaves a slot's lock free for an instant,
        # while the backlog would take minutes to drain)
        try:
            wait_until(busy, 4 * INTERVAL, "every slot still busy with the queue still full")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {app_redis.keys('pw:lock:*')} {broker.llen('payments')}"
            ) from None
        assert app_redis.get(swept) == b"victim" and worker.alive()
    assert took <= 4 * INTERVAL + 1.0, took
