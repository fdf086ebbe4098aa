"""A late heartbeat on a real Redis (docs/locks.md, "Holder liveness"): a process whose
heartbeat thread is starved past the window, but not past its key's TTL, keeps its locks,
and its senders wait for the late beat instead of giving their accounts up; one late past
the TTL finds the gap and stops them.

The heartbeat thread is given an interval of an hour, so only the test beats: the one fault
here that a test cannot make for real on demand is a thread starved of the GIL by a burst
of a thousand others (seen in scenario 5 of bench/throughput.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import REGISTRY

from payment_worker import runtime
from payment_worker.errors import LockLost
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.liveness import Liveness

TTL_MS, MARGIN_MS = 3000, 1000  # the defaults: the window is 2 s


@pytest.fixture
def late(rt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[Liveness]:
    live = Liveness(
        rt.liveness_redis, rt.keys, ttl_ms=TTL_MS, interval_ms=3_600_000, margin_ms=MARGIN_MS
    )
    monkeypatch.setattr(rt, "liveness", live)
    yield live
    live.stop()


def _lapses() -> float:
    return REGISTRY.get_sample_value("payment_worker_liveness_lapses_total") or 0.0


def _ensure_in_thread(lock: AccountLock) -> tuple[threading.Thread, list[str]]:
    """``ensure_held`` as a drain calls it before a send, in its own thread."""
    said: list[str] = []

    def check() -> None:
        try:
            lock.ensure_held()
            said.append("held")
        except LockLost as exc:
            said.append(str(exc))

    thread = threading.Thread(target=check)
    thread.start()
    return thread, said


def test_a_sender_waits_for_a_late_heartbeat_and_keeps_its_lock(
    rt: runtime.Runtime, late: Liveness, redis_client: redis.Redis
) -> None:
    lock = rt.account_lock("acct-late")
    assert lock.acquire()  # beats once, synchronously
    lapses = _lapses()
    try:
        time.sleep(MARGIN_MS / 1000 + 1.05)  # past the 2 s window; the key lives 3 s
        assert late.current_epoch() is None
        sender, said = _ensure_in_thread(lock)
        sender.join(0.1)
        assert sender.is_alive() and not said  # it waits: nothing sent, nothing given up
        assert late.beat()  # the late beat reads back the last beat's value
        sender.join(5.0)
        assert said == ["held"]
        lock.ensure_held()
        assert _lapses() == lapses
        assert redis_client.pttl(late.key) > TTL_MS - 1000
    finally:
        lock.release()


def test_a_heartbeat_late_past_its_keys_ttl_stops_the_waiting_sender(
    rt: runtime.Runtime, late: Liveness, redis_client: redis.Redis
) -> None:
    lock = rt.account_lock("acct-late")
    assert lock.acquire()
    lapses = _lapses()
    try:
        time.sleep(MARGIN_MS / 1000 + 1.05)
        sender, said = _ensure_in_thread(lock)
        sender.join(0.1)
        assert sender.is_alive()
        # the key expires (a taker may judge the holder dead now) before the beat comes
        deadline = time.monotonic() + 5.0
        while redis_client.exists(late.key) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not redis_client.exists(late.key)
        assert late.beat()
        sender.join(5.0)
        assert len(said) == 1 and "liveness" in said[0]
        assert _lapses() == lapses + 1
        with pytest.raises(LockLost, match="liveness"):
            lock.ensure_held()
    finally:
        lock.release()


def test_a_check_that_may_not_wait_gives_up_at_once(rt: runtime.Runtime, late: Liveness) -> None:
    lock = rt.account_lock("acct-late")
    assert lock.acquire()
    try:
        time.sleep(MARGIN_MS / 1000 + 1.05)
        started = time.monotonic()
        assert lock.lost
        assert time.monotonic() - started < 0.5
    finally:
        lock.release()
