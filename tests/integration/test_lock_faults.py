"""The account lock when a waiter, a holder or Redis itself fails, on a real Redis: a waiter
whose wait ended on an error is taken out of the queue by the give-back, a queued waiter
takes over the lock of a holder that died while it waited (docs/locks.md, "Blocking
acquire"), and a lock a restored Redis brings back is taken over at once ("Holder
liveness"). Each was found by a review: before, each left the account stuck for the lock's
whole TTL (30 s by default)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine

from payment_worker import lua, runtime
from payment_worker.db.engine import make_engine
from payment_worker.locks.account_lock import AccountLock, lock_is_held
from payment_worker.locks.giveback import FIRST_DELAY, GiveBack
from payment_worker.locks.liveness import lock_value
from payment_worker.redis_keys import RedisKeys
from tests.conftest import PwEnv

ACCOUNT = "acct-queue-faults"
KEYS = RedisKeys("pw")


@pytest.fixture
def engine(pw_env: PwEnv) -> Iterator[Engine]:
    eng = make_engine(pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    yield eng
    eng.dispose()


def test_a_waiter_given_back_after_an_error_leaves_the_queue(
    redis_client: redis.Redis, engine: Engine
) -> None:
    """A waiter's BLPOP and its leave both failed (Redis reset its connections), so its
    release went to the give-back thread, with its place still in the queue. The give-back
    found the lock held by the holder ("not ours") and stopped; the holder's release then
    handed the lock to the gone waiter, and nobody took it up for 30 s."""
    holder = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=30_000)
    giveback = GiveBack(threaded=False)
    waiter = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=30_000, giveback=giveback)
    assert holder.acquire(fence=False)
    token = "waiter-token"
    queue_keys = [KEYS.lock(ACCOUNT), KEYS.lock_queue(ACCOUNT), KEYS.lock_waiters(ACCOUNT)]
    wait = redis_client.register_script(lua.load("lock_wait"))
    assert wait(keys=queue_keys, args=[token, 30_000, 9_000]) == 0  # queued
    waiter._give_back_later(token)  # what a failed wait leaves behind
    time.sleep(FIRST_DELAY + 0.05)
    giveback.run_due()
    assert len(giveback) == 0
    assert redis_client.llen(KEYS.lock_queue(ACCOUNT)) == 0
    assert redis_client.hlen(KEYS.lock_waiters(ACCOUNT)) == 0
    assert holder.release()
    assert not lock_is_held(redis_client, ACCOUNT)  # released, not handed to the gone waiter


def test_a_queued_waiter_takes_over_the_lock_of_a_holder_that_died_while_it_waited(
    rt: runtime.Runtime, redis_client: redis.Redis
) -> None:
    """The holder was alive when the waiter queued (so the acquire's own takeover check let
    it be), then died without a release (its liveness key gone). Before, queued waiters
    never looked at the holder again: the account waited for the lock's TTL."""
    ttl_ms = rt.settings.lock_ttl_ms
    dead = "holder-that-dies"
    redis_client.set(rt.keys.alive(dead), "1", px=60_000)
    redis_client.set(rt.keys.lock(ACCOUNT), lock_value(dead, "its-token"), px=ttl_ms)
    lock = rt.account_lock(ACCOUNT)
    got: dict[str, float] = {}

    def wait() -> None:
        if lock.acquire(blocking=True, timeout=ttl_ms / 1000 * 0.8, fence=False):
            got["at"] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while redis_client.llen(rt.keys.lock_queue(ACCOUNT)) == 0:
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.01)
        died = time.monotonic()
        redis_client.delete(rt.keys.alive(dead))
        thread.join(ttl_ms / 1000)
        slice_s = min(ttl_ms / 3000, 4.0)  # the runtime client's 5 s socket timeout x 0.8
        assert "at" in got, "still waiting at the end of its timeout"
        assert got["at"] - died < slice_s + 2.0
        assert redis_client.llen(rt.keys.lock_queue(ACCOUNT)) == 0
        lock.ensure_held()
    finally:
        thread.join(ttl_ms / 1000)
        lock.release()


def test_a_lock_a_restored_redis_brings_back_is_taken_over_at_once(
    rt: runtime.Runtime, redis_client: redis.Redis
) -> None:
    """Redis restored from a snapshot (or a replica promoted by a failover) brings back a
    lock this process had released since, and its liveness key with an older beat's value.
    The process finds the gap at its next beat and goes on under a new holder id, so the
    restored lock names a dead holder and the next taker takes it over; before, the holder
    looked alive and the account waited for the lock's TTL."""
    live = rt.liveness
    lock = rt.account_lock(ACCOUNT)
    assert lock.acquire(fence=False)
    snapshot = {
        k: (redis_client.get(k), redis_client.pttl(k)) for k in (rt.keys.lock(ACCOUNT), live.key)
    }
    assert lock.release()
    live.beat()  # beats go on after the snapshot
    old_id = live.holder_id
    for key, (value, pttl) in snapshot.items():  # the restore
        assert value is not None
        redis_client.set(key, value, px=pttl)
    assert live.beat()  # finds the gap
    assert live.holder_id != old_id
    # the old id's key lives on for the margin only (the process stopped trusting its locks
    # at the gap), then the restored lock's holder is dead
    margin_s = rt.settings.lock_safety_margin_ms / 1000
    assert 0 < redis_client.pttl(rt.keys.alive(old_id)) <= margin_s * 1000
    deadline = time.monotonic() + margin_s + 1.0
    while redis_client.exists(rt.keys.alive(old_id)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    taker = rt.account_lock(ACCOUNT)
    assert taker.acquire(fence=False)  # no wait for the restored lock's TTL
    taker.release()
