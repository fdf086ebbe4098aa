"""Thousands of held locks in one process: one renewal thread, one round trip per tick.

Real Redis and Postgres. 2,000 account locks share the process's renewer (as the Runtime's
locks do): every lock stays renewed, only one thread renews them, the Redis commands per
second stay within what one renewal per lock per TTL/3 costs (counted by the server, INFO
commandstats), a lost or stolen key among them is noticed at once, and a release stops
that lock's renewal while the others go on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine

from payment_worker.db.engine import autocommit, make_engine
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.watchdog import COALESCE_FRACTION, Renewer, renewal_client
from tests.conftest import PwEnv, wait_until

LOCKS = 2000
TTL_MS = 3000  # a renewal per lock every second
INTERVAL = TTL_MS / 3000


@pytest.fixture
def engine(pw_env: PwEnv) -> Iterator[Engine]:
    # the fencing upsert's engine in the service: an autocommit view of the pool
    eng = autocommit(
        make_engine(pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    )
    yield eng
    eng.dispose()


def _calls(r: redis.Redis) -> dict[str, int]:
    stats = r.info("commandstats")
    return {name: int(v["calls"]) for name, v in stats.items()}


def _renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lock-renewer")]


def test_two_thousand_locks_one_thread_bounded_commands(
    redis_client: redis.Redis, engine: Engine
) -> None:
    renewer = Renewer(renewal_client(redis_client, TTL_MS))
    lost: dict[str, str] = {}
    locks = [
        AccountLock(
            redis_client,
            f"acct-{i:05d}",
            engine=engine,
            ttl_ms=TTL_MS,
            safety_margin_ms=500,
            renewer=renewer,
            on_lost=lambda reason, i=i: lost.__setitem__(f"acct-{i:05d}", reason),
        )
        for i in range(LOCKS)
    ]
    threads_before = len(threading.enumerate())
    try:
        for lock in locks:
            assert lock.acquire()
        assert len(renewer) == LOCKS
        assert len(_renewer_threads()) == 1
        assert len(threading.enumerate()) == threads_before + 1

        # hold for four intervals and count what the server sees
        hold = 4 * INTERVAL
        calls0, batches0, sent0 = _calls(redis_client), renewer.batches, renewer.renewals
        t0 = time.monotonic()
        end = t0 + hold
        while time.monotonic() < end:
            time.sleep(0.2)
            for lock in locks[::100]:
                lock.progress()
                lock.ensure_held()
        elapsed = time.monotonic() - t0
        calls1, batches, sent = (
            _calls(redis_client),
            renewer.batches - batches0,
            renewer.renewals - sent0,
        )
        evalsha = calls1["cmdstat_evalsha"] - calls0.get("cmdstat_evalsha", 0)
        total = sum(calls1.values()) - sum(calls0.values())
        per_s = total / elapsed
        print(
            f"\n{LOCKS} locks, TTL {TTL_MS} ms, {elapsed:.2f} s: {sent} renewals in {batches}"
            f" round trips, EVALSHA {evalsha / elapsed:.0f}/s, all commands {per_s:.0f}/s"
            f" (incl. GET+PEXPIRE inside the script), threads {len(_renewer_threads())}"
        )
        # every lock renewed about once per interval, never more than 10 % early
        per_lock = LOCKS * elapsed / INTERVAL
        assert 0.8 * per_lock - LOCKS <= sent <= per_lock / (1 - COALESCE_FRACTION) + LOCKS
        assert evalsha <= sent + 10  # one EVALSHA per renewal, nothing else per lock
        # one script = EVALSHA + GET + PEXPIRE: three commands per renewal, plus INFO's own
        assert per_s <= 3 * LOCKS / (INTERVAL * (1 - COALESCE_FRACTION)) + 50
        # round trips do not grow with the number of locks: at most one per coalescing window
        assert batches <= elapsed / (INTERVAL * COALESCE_FRACTION) + 2
        for lock in locks:
            assert lock.held
        pttls = redis_client.pipeline(transaction=False)
        for lock in locks:
            pttls.pttl(lock.key)
        assert min(pttls.execute()) > TTL_MS - 2 * INTERVAL * 1000  # renewed, never near expiry
        assert lost == {}

        # one key gone, one stolen: noticed within an interval, and only those two
        redis_client.delete(locks[7].key)
        redis_client.set(locks[8].key, "someone-else", px=60_000)
        wait_until(lambda: len(lost) == 2, INTERVAL + 1.0, "the two losses")
        assert lost == {"acct-00007": "expired", "acct-00008": "stolen"}
        assert redis_client.get(locks[8].key) == b"someone-else"  # not extended
        assert len(renewer) == LOCKS - 2

        # releases stop renewal at once; what is still held goes on being renewed
        for lock in locks[: LOCKS // 2]:
            lock.release()
        assert len(renewer) == LOCKS // 2
        time.sleep(1.5 * INTERVAL)
        for lock in locks[LOCKS // 2 :]:
            lock.ensure_held()
        for lock in locks[LOCKS // 2 :]:
            assert lock.release()
        time.sleep(0.2)  # a batch that was in flight during the last releases has returned
        sent, evalsha = renewer.renewals, _calls(redis_client)["cmdstat_evalsha"]
        time.sleep(1.5 * INTERVAL)
        # nothing held: nothing sent
        assert renewer.renewals == sent
        assert _calls(redis_client)["cmdstat_evalsha"] == evalsha
        assert redis_client.dbsize() == 1  # only the stolen key is left (not ours)
    finally:
        renewer.close()
        for lock in locks:
            lock._token = None  # nothing to release after a failure: the keys expire
