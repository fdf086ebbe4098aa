"""The liveness rules on a fake clock and a scripted Redis (no services): when a process
vouches for its locks, and which heartbeats start a new epoch (docs/locks.md)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from payment_worker.dev.faults import holder_pid
from payment_worker.locks.liveness import Liveness, holder_of, lock_value, make_holder_id
from payment_worker.redis_keys import RedisKeys
from payment_worker.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedRedis:
    """The liveness key as Redis keeps it, on the fake clock: ``SET … PX … GET`` answers
    what the key held (None: missing or expired), or an error."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.value: bytes | None = None
        self.expires_at = 0.0
        self.down = False
        self.sets = 0

    def held(self) -> bytes | None:
        return self.value if self.clock.now < self.expires_at else None

    def set(self, key: str, value: Any, px: int, get: bool) -> bytes | None:
        assert get and px == 3000
        if self.down:
            raise RedisConnectionError("refused")
        self.sets += 1
        old = self.held()
        self.value, self.expires_at = value, self.clock.now + px / 1000
        return old

    def pipeline(self, transaction: bool) -> ScriptedPipeline:
        assert not transaction
        return ScriptedPipeline(self)


class ScriptedPipeline:
    """A beat's one round trip: the ``SET … GET`` above, and the registry's entry."""

    def __init__(self, r: ScriptedRedis) -> None:
        self.r = r
        self.calls: list[Any] = []

    def set(self, key: str, value: Any, px: int, get: bool) -> None:
        self.calls.append(lambda: self.r.set(key, value, px=px, get=get))

    def eval(self, script: str, numkeys: int, key: str, holder: str) -> None:
        # the registry's entry (lua/holder_register.lua: ZADD on the server's clock)
        assert "ZADD" in script and numkeys == 1
        assert key == "pw:holders" and holder == "host-7-abcd"
        self.calls.append(lambda: 1)

    def execute(self) -> list[Any]:
        return [call() for call in self.calls]


@pytest.fixture
def parts() -> tuple[Liveness, ScriptedRedis, Clock]:
    clock = Clock()
    r = ScriptedRedis(clock)
    live = Liveness(
        r,  # type: ignore[arg-type]
        RedisKeys(),
        ttl_ms=3000,
        interval_ms=500,
        margin_ms=1000,
        clock=clock,
        holder_id="host-7-abcd",
    )
    return live, r, clock


def test_lock_values_name_their_holder() -> None:
    holder = make_holder_id()
    assert ":" not in holder and "{" not in holder and "}" not in holder
    assert holder_pid(holder) is not None
    value = lock_value(holder, "ab" * 16)
    assert holder_of(value) == holder and holder_of(value.encode()) == holder
    # a lock taken without liveness (a bare token) has no holder: only its TTL frees it
    assert holder_of("ab" * 16) is None and holder_of(None) is None
    assert RedisKeys().alive(holder) == f"pw:alive:{{{holder}}}"


def test_vouches_while_the_last_beat_is_recent(parts: Any) -> None:
    live, _, clock = parts
    assert live.current_epoch() is None  # never beaten: no lock may be taken
    assert live.beat()
    epoch = live.current_epoch()
    assert epoch == 1 and live.vouches(1)
    clock.now += 1.9  # the window is TTL - margin = 2 s
    assert live.vouches(1)
    clock.now += 0.2
    assert not live.vouches(1)  # a paused or starved process stops trusting its locks


def test_a_beat_after_a_gap_starts_a_new_epoch(parts: Any) -> None:
    live, _, clock = parts
    live.beat()
    clock.now += 0.5
    live.beat()
    assert live.current_epoch() == 1  # continuous: same epoch
    clock.now += 5.0  # SIGSTOP: the key expired meanwhile
    live.beat()
    assert live.current_epoch() == 2 and not live.vouches(1)


def test_a_beat_that_finds_its_key_missing_starts_a_new_epoch(parts: Any) -> None:
    live, r, clock = parts
    live.beat()
    clock.now += 0.5
    r.value = None  # FLUSHDB of the lock store
    live.beat()
    assert live.current_epoch() == 2 and not live.vouches(1)


def test_each_beat_writes_a_value_of_its_own(parts: Any) -> None:
    live, r, clock = parts
    seen = set()
    for _ in range(3):
        live.beat()
        seen.add(r.value)
        clock.now += 0.5
    assert len(seen) == 3


def test_a_beat_that_finds_another_beats_value_starts_a_new_epoch(parts: Any) -> None:
    """A beat whose reply was lost may still have run, even after the key expired: the key
    then holds its value, not the last known success's, and nothing proves it never
    lapsed."""
    live, r, clock = parts
    live.beat()
    clock.now += 0.5
    r.set(live.key, b"a-beat-whose-reply-was-lost", px=3000, get=True)
    live.beat()
    assert live.current_epoch() == 2 and not live.vouches(1)


def test_a_late_beat_that_finds_its_key_unbroken_keeps_the_epoch(parts: Any) -> None:
    """The heartbeat thread starved (a burst of the process's own threads) past the window
    but not past the key's TTL: the locks are not vouched for meanwhile, and vouched for
    again once the late beat reads back the last beat's value."""
    live, _, clock = parts
    live.beat()
    clock.now += 2.4  # window 2 s, TTL 3 s
    assert not live.vouches(1)
    assert live.beat() and live.current_epoch() == 1 and live.vouches(1)


def test_failed_beats_change_nothing_until_the_key_could_have_lapsed(parts: Any) -> None:
    live, r, clock = parts
    live.beat()
    r.down = True
    clock.now += 1.0
    assert not live.beat() and live.vouches(1)
    clock.now += 1.5
    assert not live.vouches(1)  # unreachable past the window: nothing is sent meanwhile
    r.down = False
    assert live.beat() and live.current_epoch() == 1  # reachable again before the TTL ran out
    r.down = True
    clock.now += 3.5
    r.down = False
    assert live.beat() and live.current_epoch() == 2  # past it: the gap is noticed on recovery


def test_a_sender_waits_for_a_late_beat(parts: Any) -> None:
    live, _, clock = parts
    live.beat()
    clock.now += 2.4
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(live.await_vouch(1, 10.0)))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()  # no beat yet: it waits, it does not decide
    live.beat()
    waiter.join(5.0)
    assert got == [True]


def test_a_waiting_sender_learns_of_a_gap_a_stop_or_its_timeout(parts: Any) -> None:
    live, _, clock = parts
    live.beat()
    clock.now += 2.4
    started = time.monotonic()
    assert not live.await_vouch(1, 0.05)  # no beat came
    assert time.monotonic() - started >= 0.05
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(live.await_vouch(1, 10.0)))
    waiter.start()
    waiter.join(0.1)
    clock.now += 1.0  # past the TTL: the late beat finds the key missing
    live.beat()
    waiter.join(5.0)
    assert got == [False] and live.current_epoch() == 2
    assert not live.await_vouch(1, 10.0)  # a known gap: no wait at all
    live.stop(forget=False)
    assert not live.await_vouch(2, 10.0)


def test_a_stopped_liveness_vouches_for_nothing(parts: Any) -> None:
    live, _, _ = parts
    live.beat()
    live.stop(forget=False)
    assert live.current_epoch() is None and not live.beat()
    assert live.epoch_for_acquire() is None


def test_the_interval_must_survive_one_missed_beat() -> None:
    with pytest.raises(ValueError, match="LIVENESS_INTERVAL_MS"):
        Settings(liveness_ttl_ms=3000, liveness_interval_ms=1500, lock_safety_margin_ms=1000)
    Settings(liveness_ttl_ms=3000, liveness_interval_ms=1000, lock_safety_margin_ms=1000)


def test_each_gap_between_successful_beats_is_observed(parts: Any) -> None:
    """``payment_worker_liveness_beat_gap_seconds``: from one good beat's send to the next
    one's reply (the fake clock does not move during a beat), so a process near a lapse shows
    before it has one."""
    name = "payment_worker_liveness_beat_gap_seconds"

    def seen(suffix: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name + suffix, labels) or 0.0

    live, _, clock = parts
    count, total, late = seen("_count"), seen("_sum"), seen("_bucket", le="1.0")
    live.beat()  # the first: no gap yet
    clock.now += 0.5
    live.beat()
    clock.now += 1.75  # starved, still within the 2 s window: no lapse
    live.beat()
    assert live.current_epoch() == 1
    assert seen("_count") - count == 2
    assert seen("_sum") - total == pytest.approx(2.25)
    assert seen("_bucket", le="1.0") - late == 1  # the 0.5 s one; the 1.75 s one is above


def test_takers_that_find_the_beat_stale_at_once_make_one_beat(parts: Any) -> None:
    """``epoch_for_acquire`` of many takers at once: the first beats, the others find the
    state fresh once their turn comes (``beat(unless_fresh=True)``), not one beat each."""
    live, r, clock = parts
    live.beat()
    clock.now += 2.4
    before = r.sets
    assert live.beat(unless_fresh=True) and live.beat(unless_fresh=True)
    assert r.sets - before == 1


def test_one_beat_wakes_every_waiting_sender(parts: Any) -> None:
    live, _, clock = parts
    live.beat()
    clock.now += 2.4
    got: list[bool] = []
    waiters = [
        threading.Thread(target=lambda: got.append(live.await_vouch(1, 10.0))) for _ in range(50)
    ]
    for w in waiters:
        w.start()
    time.sleep(0.2)
    assert not got  # all waiting
    live.beat()
    for w in waiters:
        w.join(5.0)
    assert got == [True] * 50
