"""Issue 13, a small scenario 4: the plain command holds many accounts in flight at once.

Two real ``celery -A payment_worker worker`` processes with no ``-P``/``-c`` (the settings'
defaults), the simulator answering every request after 500 ms. Each account needs a token
and eight payments, so it is in flight for at least 4.5 s: a fleet that holds the accounts
at once has nearly all of them in progress at the simulator together, a fleet limited by
its slots or its database connections has only that many. The assertion is on the count
the simulator saw (distinct accounts with a request in progress), not on a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from payment_worker import runtime
from payment_worker.db.work import open_counts
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from payment_worker.worker.celery_app import app
from payment_worker.worker.queueing import enqueue_batch
from tests.conftest import PwEnv, wait_until

# run alone, after the parallel part of `make test`: it asserts how many accounts are in flight at
# once, which shared CPU lowers
pytestmark = pytest.mark.exclusive

ACCOUNTS = 100
ITEMS = 8
LATENCY_MS = 500


def _done(total: int) -> bool:
    with runtime.current().engine.connect() as conn:
        counts = open_counts(conn)
    return sum(counts.get(s, 0) for s in ("succeeded", "failed", "dead")) >= total


def test_plain_command_holds_most_accounts_in_flight_at_once(pw_env: PwEnv, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_POOL", "WORKER_CONCURRENCY")}
    env.update({"METRICS_PORT": "0", "LOG_LEVEL": "WARNING", "GATEWAY_RATE_PER_SECOND": "100"})
    batches = make_batches(batches=ACCOUNTS, items=ITEMS, accounts=ACCOUNTS, prefix="conc")
    for b in batches:
        assert submit_batch(b, enqueue=False).status == "accepted"
    with LocalCluster(workdir=tmp_path, env=env, pool=None, concurrency=None) as cluster:
        cluster.start_simulator(rate=100, latency_ms=LATENCY_MS)
        workers = [cluster.start_worker(), cluster.start_worker()]
        # both consumers up before the load arrives, so neither takes it all
        wait_until(lambda: len(app.control.ping(timeout=0.5)) == 2, 60, "both workers up")

        for b in batches:
            enqueue_batch(b["batch_id"])
        wait_until(lambda: _done(ACCOUNTS * ITEMS), 90, "every item terminal")
        in_flight = httpx.get(f"{cluster.sim_url}/_sim/in_flight", timeout=10).json()
        ledger = cluster.ledger()
        argv = workers[0].argv
    # the plain command: the pool and the slots come from the settings
    assert not {"-P", "--pool", "-c", "--concurrency"} & set(argv), argv
    assert ledger["double_payments"] == []
    assert ledger["payments_sent"] == ACCOUNTS * ITEMS
    assert in_flight["max"] >= 0.8 * ACCOUNTS, in_flight
