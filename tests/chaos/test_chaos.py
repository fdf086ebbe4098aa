"""Chaos: kill, pause and starve real workers while the gateway misbehaves.

Checked at the end against the simulator's ledger and Postgres: zero double payments, zero
lost transactions, every item terminal within a bounded time after the faults stop.

The default run is the short variant (CI, under 3 minutes). ``make chaos`` sets
PW_CHAOS_LONG=1: 10 minutes of faults over 20,000 items, with worker memory sampled.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import redis

from payment_worker import runtime
from payment_worker.db.work import open_counts
from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.dev.reconcile import reconcile
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import PwEnv

LONG = os.environ.get("PW_CHAOS_LONG") == "1"
FAULTS = {"p503": 0.05, "p_lost": 0.03, "p_slow": 0.02}


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _terminal(counts: dict[str, int]) -> int:
    return sum(counts.get(s, 0) for s in ("succeeded", "failed", "dead"))


def test_chaos(pw_env: PwEnv, tmp_path: Path) -> None:
    if LONG:
        n_batches, n_items, accounts, fault_seconds = 400, 50, 40, 600.0
    else:
        n_batches, n_items, accounts, fault_seconds = 80, 50, 10, 60.0
    total = n_batches * n_items
    lock_ttl_ms = 3000
    env = {
        **os.environ,
        "METRICS_PORT": "0",
        "LOCK_TTL_MS": str(lock_ttl_ms),
        "LOCK_SAFETY_MARGIN_MS": "500",
        "GATEWAY_READ_TIMEOUT": "1.0",
        # 20 requests/s per account (simulator and client alike): the work lasts long enough
        # for every fault to strike while payments are in progress
        "GATEWAY_RATE_PER_SECOND": "20",
        "SWEEPER_INTERVAL": "1",
        "SWEEPER_STALE_AFTER": "6",
        "RETRY_BASE_DELAY": "0.2",
        "RETRY_MAX_DELAY": "5",
        "RETRY_MAX_ATTEMPTS": "15",
    }
    rng = random.Random(7)
    broker = redis.Redis.from_url(pw_env.broker_url)
    batches = make_batches(
        batches=n_batches, items=n_items, accounts=accounts, prefix="chaos", reject_every=53
    )
    with LocalCluster(workdir=tmp_path, env=env, concurrency=4) as cluster:
        cluster.start_simulator(rate=20, token_ttl=5, slow_seconds=2.5, seed=11, **FAULTS)
        # the long run submits steadily over 90% of its fault period; the short one at once
        upfront = n_batches if not LONG else 0
        for b in batches[:upfront]:
            assert submit_batch(b).status == "accepted"
        submitted = upfront
        witness = cluster.start_worker()  # never killed nor paused: its memory must stay flat
        for _ in range(2):
            cluster.start_worker()
        cluster.start_beat()
        witness_rss: list[tuple[float, int]] = []

        start = time.monotonic()
        kills = pauses = flushes = 0
        rss: list[int] = []
        next_kill = start + 3
        next_pause = start + 5
        next_flush = start + 9
        open_at_flush = 0
        while time.monotonic() - start < fault_seconds:
            now = time.monotonic()
            due = int(n_batches * min((now - start) / (fault_seconds * 0.9), 1.0))
            while submitted < max(due, upfront):
                assert submit_batch(batches[submitted]).status == "accepted"
                submitted += 1
            workers = [w for w in cluster.workers() if w is not witness]
            rss.append(sum(_rss_kb(w.pid) for w in cluster.workers()))
            witness_rss.append((now - start, _rss_kb(witness.pid)))
            if now >= next_kill and workers:
                rng.choice(workers).kill()
                cluster.start_worker()
                kills += 1
                next_kill = now + (rng.uniform(20, 40) if LONG else rng.uniform(3, 6))
            if now >= next_pause and workers:
                victim = rng.choice(workers)
                victim.pause()
                time.sleep(lock_ttl_ms / 1000 + 2)  # longer than the lock TTL
                victim.resume()
                pauses += 1
                next_pause = now + (60 if LONG else 1e9)
            if now >= next_flush:
                open_at_flush = total - _terminal(open_counts_now())
                broker.flushdb()  # the broker loses every queued message
                flushes += 1
                next_flush = now + (120 if LONG else 1e9)
            if not LONG and pauses and flushes and _terminal(open_counts_now()) >= total:
                break
            time.sleep(0.5)

        # faults stop; everything must become terminal within a bounded time
        cluster.configure_simulator(p503=0, p_lost=0, p_slow=0)
        bound = 150.0
        deadline = time.monotonic() + bound
        counts = open_counts_now()
        while time.monotonic() < deadline and _terminal(counts) < total:
            time.sleep(1)
            counts = open_counts_now()
        ledger = cluster.ledger()
        for w in cluster.workers():
            w.signal(signal.SIGCONT)

    assert _terminal(counts) == total, f"not all terminal within {bound}s: {counts}"
    with runtime.current().engine.connect() as conn:
        rec = reconcile(conn, ledger)
    assert not rec.double_paid, rec.summary()
    assert rec.ok, rec.summary()
    # invariant 4: one request of an account in flight at a time from our side (the simulator
    # frees a slow or lost request's slot once the payment is applied, so none is excused)
    assert ledger["http_429_by_cause"]["concurrency"] == 0, ledger["http_429_by_cause"]
    assert max(ledger["max_in_flight_seen"].values()) == 1
    assert submitted == n_batches
    assert kills >= 1 and pauses >= 1 and flushes >= 1
    assert open_at_flush > 0  # the flush really lost messages of unfinished work
    if LONG:
        # flat memory: the witness worker's RSS over the last quarter stays within 25% of
        # what it was once warmed up (after the first quarter)
        q = len(witness_rss) // 4
        warm = max(r for _, r in witness_rss[q : 2 * q])
        late = max(r for _, r in witness_rss[3 * q :])
        print(f"witness RSS kB: warm={warm} late={late} samples={witness_rss[::120]}")
        assert late <= warm * 1.25, (warm, late)
    print(
        f"chaos: items={total} kills={kills} pauses={pauses} flushes={flushes} "
        f"open_at_flush={open_at_flush} counts={counts} 401={ledger.get('http_401')} "
        f"tokens={ledger.get('tokens_issued')} 429={ledger.get('http_429_by_cause')} "
        f"rss_kb first={rss[:1]} last={rss[-1:]}"
    )


def open_counts_now() -> dict[str, int]:
    with runtime.current().engine.connect() as conn:
        return open_counts(conn)
