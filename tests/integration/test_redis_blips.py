"""A lock-store blip costs a pause, not a task: a real worker draining against the simulator
while every connection to its Redis (``REDIS_URL``: locks, liveness, pacing, tokens, marks)
is cut and refused for two seconds, then accepted again. The broker (``CELERY_BROKER_URL``)
stays up.

Before, every task that met the outage at its lock take raised: a ``task_crashed`` dead letter
per message, for on-call to close, though nothing was wrong with the batch. Now the task ends
as ``redis_unavailable`` (no dead letter), its take given back if it ran, and the sweeper
sends the account again once Redis answers. The assertions are the other blip tests' (no
task failed, every item finished, nothing paid twice) and the outage's own visible trace.

The fault is real: a TCP proxy in front of Redis (tests/lock_helpers.py) closes every
connection and refuses new ones, as a restarting Redis does.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from payment_worker.worker.queueing import enqueue_batch
from tests.blips import assert_nothing_lost_or_doubled, run_with_fault, series
from tests.conftest import PwEnv
from tests.lock_helpers import TcpProxy

pytestmark = pytest.mark.integration


def test_a_lock_store_outage_costs_a_pause_not_a_task(pw_env: PwEnv, tmp_path: Path) -> None:
    url = urlsplit(pw_env.redis_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 6379)
    proxied = urlunsplit(url._replace(netloc=f"127.0.0.1:{proxy.port}"))
    outage: list[float] = []

    def cut_redis(_pid: int) -> None:
        t0 = time.monotonic()
        proxy.cut()
        # a message that arrives during the outage (the broker is up): its task meets it at
        # its lock take, whatever the drains in flight were doing then (a holder between two
        # requests needs no Redis for 2 s: its token, pacing lease and lock are in hand)
        enqueue_batch("blip-batch-00000")
        time.sleep(2.0)
        proxy.reopen()
        outage.append(time.monotonic() - t0)

    try:
        out = run_with_fault(
            pw_env,
            tmp_path,
            accounts=20,
            items=40,
            fault=cut_redis,
            env={"REDIS_URL": proxied, "SWEEPER_STALE_AFTER": "2"},
            latency_ms=50,
            # a slot free for the message sent during the outage, whatever the drains do
            concurrency=32,
        )
    finally:
        proxy.cut()
    assert outage and outage[0] >= 2.0
    assert_nothing_lost_or_doubled(out)
    executions = series(out["metrics"], "payment_worker_task_executions_total")
    # the outage was met: the heartbeats failed, and the task of the message that arrived
    # during it ended redis_unavailable (no crash record: checked above)
    assert series(out["metrics"], "payment_worker_liveness_beats_total").get("error", 0) > 0
    assert executions.get("redis_unavailable", 0) > 0, executions
    print(f"\noutage {outage[0]:.1f}s; executions {executions}")
