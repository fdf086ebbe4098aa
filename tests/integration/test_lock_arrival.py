"""A task's lock attempt carries its work (locks/arrival.py, lua/lock_take.lua): the mark a
busy holder checks after releasing, or, when the lock is taken, every mark cleared; one
Redis round trip where there were three (mark, SET NX, delete the marks). The holder's
release reads the mark in its own round trip (lua/lock_release.lua, KEYS[4])."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from payment_worker import runtime
from payment_worker.locks.liveness import holder_of, lock_value
from payment_worker.worker.queueing import RedisAccountQueue

pytestmark = pytest.mark.integration

ACCT = "acct-1"


def _marks(r: redis.Redis, rt: runtime.Runtime, acct: str = ACCT) -> dict[str, Any]:
    k = rt.keys
    return {
        "waiting": r.get(k.waiting(acct)),
        "swept": r.get(k.swept(acct)),
        "queued": r.get(k.queued(acct)),
    }


def _set_marks(r: redis.Redis, rt: runtime.Runtime, acct: str = ACCT) -> None:
    k = rt.keys
    r.set(k.waiting(acct), "b-earlier", px=60_000)
    r.set(k.swept(acct), "1", px=60_000)
    r.set(k.queued(acct), "123", px=60_000)


@pytest.fixture
def commands(rt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The commands the runtime's Redis client sends, by name (each one a round trip)."""
    sent: list[str] = []
    client = rt.redis
    original = client.execute_command

    def counting(*args: Any, **options: Any) -> Any:
        sent.append(str(args[0]))
        return original(*args, **options)

    monkeypatch.setattr(client, "execute_command", counting)
    yield sent


def test_a_free_lock_is_taken_and_every_mark_cleared_in_one_round_trip(
    rt: runtime.Runtime, redis_client: redis.Redis, commands: list[str]
) -> None:
    queue = RedisAccountQueue(rt)
    warm = rt.account_lock("acct-warm")  # the script is loaded into Redis once
    assert warm.acquire(arrival=queue.arrival("acct-warm", "b-0"))
    warm.release()
    _set_marks(redis_client, rt)
    commands.clear()
    lock = rt.account_lock(ACCT)
    assert lock.acquire(arrival=queue.arrival(ACCT, "b-1"))
    try:
        assert commands == ["EVALSHA"]
        assert lock.fence_token == 1
        assert _marks(redis_client, rt) == {"waiting": None, "swept": None, "queued": None}
        assert holder_of(redis_client.get(rt.keys.lock(ACCT))) == rt.liveness.holder_id
        lock.ensure_held()
    finally:
        lock.release()


def test_a_busy_lock_leaves_the_mark_for_its_holder(
    rt: runtime.Runtime, redis_client: redis.Redis
) -> None:
    queue = RedisAccountQueue(rt)
    holder = rt.account_lock(ACCT)
    assert holder.acquire(arrival=queue.arrival(ACCT, "b-1"))
    released = False
    try:
        redis_client.set(rt.keys.queued(ACCT), "123", px=60_000)  # a message on its way
        late = rt.account_lock(ACCT)
        assert not late.acquire(arrival=queue.arrival(ACCT, "b-2"))
        assert late.fence_token is None
        # the mark names the late batch, lives as long as the queue's marks do, and the
        # queued mark stays (the holder's take cleared it before it was set)
        assert redis_client.get(rt.keys.waiting(ACCT)) == b"b-2"
        mark_ms = rt.settings.lock_ttl_ms * 4
        assert mark_ms - 1000 < redis_client.pttl(rt.keys.waiting(ACCT)) <= mark_ms
        assert redis_client.get(rt.keys.queued(ACCT)) == b"123"
        assert queue.announced(ACCT)
    finally:
        released = holder.release(queue.arrival(ACCT, "b-1"))
    assert released
    assert holder.marked is True  # the holder learns of b-2 as it releases
    # its next attempt takes the lock and clears the mark; the next release finds none
    again = rt.account_lock(ACCT)
    assert again.acquire(arrival=queue.arrival(ACCT, "b-1"))
    assert again.release(queue.arrival(ACCT, "b-1"))
    assert again.marked is False and not queue.announced(ACCT)


def test_a_release_reads_the_mark_in_its_own_round_trip(
    rt: runtime.Runtime, redis_client: redis.Redis, commands: list[str]
) -> None:
    queue = RedisAccountQueue(rt)
    lock = rt.account_lock(ACCT)
    assert lock.acquire(arrival=queue.arrival(ACCT, "b-1"))
    redis_client.set(rt.keys.waiting(ACCT), "b-2", px=60_000)  # a task found it busy
    commands.clear()
    assert lock.release(queue.arrival(ACCT, "b-1"))
    assert commands == ["EVALSHA"] and lock.marked is True
    assert not redis_client.exists(rt.keys.lock(ACCT))
    # a lock no longer ours is not touched, and the mark is read all the same
    assert lock.acquire(arrival=queue.arrival(ACCT, "b-1"))
    redis_client.set(rt.keys.lock(ACCT), "someone-else-1-x:abc", px=30_000)
    redis_client.set(rt.keys.waiting(ACCT), "b-3", px=60_000)
    assert not lock.release(queue.arrival(ACCT, "b-1"))
    assert lock.marked is True
    assert redis_client.get(rt.keys.lock(ACCT)) == b"someone-else-1-x:abc"
    # without an arrival nothing is read
    other = rt.account_lock("acct-2")
    assert other.acquire()
    assert other.release() and other.marked is None


def test_a_dead_holders_lock_taken_over_clears_the_marks(
    rt: runtime.Runtime, redis_client: redis.Redis
) -> None:
    redis_client.set(rt.keys.lock(ACCT), lock_value("ghost-41-dead0001", "f" * 32), px=30_000)
    _set_marks(redis_client, rt)
    lock = rt.account_lock(ACCT)
    assert lock.acquire(arrival=RedisAccountQueue(rt).arrival(ACCT, "b-1"))
    try:
        assert holder_of(redis_client.get(rt.keys.lock(ACCT))) == rt.liveness.holder_id
        assert _marks(redis_client, rt) == {"waiting": None, "swept": None, "queued": None}
    finally:
        lock.release()


def test_no_lock_attempt_without_liveness_still_leaves_the_mark(
    rt: runtime.Runtime, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that cannot prove it is alive takes no lock, but the work it brought is
    marked, as before the attempt was one script."""
    monkeypatch.setattr(rt.liveness, "epoch_for_acquire", lambda: None)
    lock = rt.account_lock(ACCT)
    assert not lock.acquire(arrival=RedisAccountQueue(rt).arrival(ACCT, "b-9"))
    assert redis_client.get(rt.keys.waiting(ACCT)) == b"b-9"
    assert not redis_client.exists(rt.keys.lock(ACCT))
