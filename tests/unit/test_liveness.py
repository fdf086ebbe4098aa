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
from tests.fakes import FakeClock


class ScriptedRedis:
    """The liveness keys as Redis keeps them, on the fake clock: ``SET … PX … GET`` answers
    what the key held (None: missing or expired), or an error. ``value``: the key last
    written (None after a flush)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.store: dict[str, tuple[bytes, float]] = {}
        self.last_key = ""
        self.down = False
        self.sets = 0
        self.holders: list[str] = []  # the registry's entries, in order

    def held(self, key: str) -> bytes | None:
        value, expires_at = self.store.get(key, (b"", 0.0))
        return value if self.clock.now < expires_at else None

    @property
    def value(self) -> bytes | None:
        return self.held(self.last_key)

    @value.setter
    def value(self, value: bytes | None) -> None:
        assert value is None  # a FLUSHDB
        self.store.clear()

    def set(self, key: str, value: Any, px: int, get: bool = False) -> bytes | None:
        assert px == 3000
        if self.down:
            raise RedisConnectionError("refused")
        self.sets += 1
        old = self.held(key)
        self.store[key] = (value, self.clock.now + px / 1000)
        self.last_key = key
        return old if get else None

    def pexpire(self, key: str, ms: int) -> int:
        if self.held(key) is None:
            return 0
        self.store[key] = (self.store[key][0], self.clock.now + ms / 1000)
        return 1

    def pipeline(self, transaction: bool) -> ScriptedPipeline:
        assert not transaction
        return ScriptedPipeline(self)


class ScriptedPipeline:
    """A beat's one round trip: the ``SET … GET`` above, and the registry's entry."""

    def __init__(self, r: ScriptedRedis) -> None:
        self.r = r
        self.calls: list[Any] = []

    def set(self, key: str, value: Any, px: int, get: bool = False) -> None:
        self.calls.append(lambda: self.r.set(key, value, px=px, get=get))

    def eval(self, script: str, numkeys: int, key: str, holder: str) -> None:
        # the registry's entry (lua/holder_register.lua: ZADD on the server's clock)
        assert "ZADD" in script and numkeys == 1 and key == "pw:holders"
        self.calls.append(lambda: self.r.holders.append(holder) or 1)

    def pexpire(self, key: str, ms: int) -> None:
        self.calls.append(lambda: self.r.pexpire(key, ms))

    def execute(self) -> list[Any]:
        return [call() for call in self.calls]


@pytest.fixture
def parts() -> tuple[Liveness, ScriptedRedis, FakeClock]:
    clock = FakeClock()
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


def _restored(live: Liveness, r: ScriptedRedis, clock: FakeClock) -> tuple[str, str]:
    """Two beats, then the liveness key restored with the first's value (a snapshot taken
    between them), half a second on: the next beat finds a gap within the window. Returns
    the holder id and key of before."""
    live.beat()
    old_id, old_key = live.holder_id, live.key
    before = r.value
    clock.now += 0.5
    live.beat()
    r.set(old_key, before, px=3000)
    clock.now += 0.5
    return old_id, old_key


def test_a_gap_goes_on_under_a_new_holder_id_and_the_old_one_is_dead(parts: Any) -> None:
    """A Redis restored from a snapshot, or a replica promoted by a failover, brings back
    the liveness key with an older beat's value (a gap) and locks this process released
    since, naming it. Under its old id it would look alive and keep takers off those locks
    for their TTL (a review found it): the old id's key expires after the margin (the
    process stopped trusting its locks at the gap), and it beats under a new one."""
    live, r, clock = parts
    old_id, old_key = _restored(live, r, clock)
    assert live.beat() and live.current_epoch() == 2
    assert live.holder_id != old_id and live.key == RedisKeys().alive(live.holder_id)
    assert r.held(old_key) is not None and r.held(live.key) is not None
    clock.now += 1.0  # the margin
    assert r.held(old_key) is None
    assert r.holders[-1] == live.holder_id
    clock.now += 0.5
    assert live.beat() and live.current_epoch() == 2  # the new key goes on unbroken


def test_a_rotation_that_fails_keeps_the_old_id_and_vouches_for_nothing_new(
    parts: Any,
) -> None:
    """The gap is found within the window (a restored key), and the new id's write fails:
    the locks of before the gap must not be trusted meanwhile (a review found them trusted
    until the window ran out, the epoch bumped only with a successful write)."""
    live, r, clock = parts
    old_id, _ = _restored(live, r, clock)
    real_pexpire = r.pexpire

    def refuse(key: str, ms: int) -> int:
        raise RedisConnectionError("reset")

    r.pexpire = refuse  # type: ignore[method-assign]
    assert not live.beat()
    # the gap's epoch at once, vouched for by nothing: the old locks are not trusted
    assert live.holder_id == old_id and live.current_epoch() is None and not live.vouches(1)
    r.pexpire = real_pexpire  # type: ignore[method-assign]
    assert live.beat() and live.current_epoch() == 2 and live.holder_id != old_id


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
