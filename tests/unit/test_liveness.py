"""The liveness rules on a fake clock and a scripted Redis (no services): when a process
vouches for its locks, and which heartbeats start a new epoch (docs/locks.md)."""

from __future__ import annotations

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
    """``SET … GET`` answers: what the key held before (None: missing), or an error."""

    def __init__(self) -> None:
        self.key_exists = False
        self.down = False
        self.sets = 0

    def set(self, key: str, value: Any, px: int, get: bool) -> bytes | None:
        assert get and px == 3000
        if self.down:
            raise RedisConnectionError("refused")
        self.sets += 1
        old = b"1" if self.key_exists else None
        self.key_exists = True
        return old

    def pipeline(self, transaction: bool) -> ScriptedPipeline:
        assert not transaction
        return ScriptedPipeline(self)


class ScriptedPipeline:
    """A beat's one round trip: the ``SET … GET`` above, and the registry's ``ZADD``."""

    def __init__(self, r: ScriptedRedis) -> None:
        self.r = r
        self.calls: list[Any] = []

    def set(self, key: str, value: Any, px: int, get: bool) -> None:
        self.calls.append(lambda: self.r.set(key, value, px=px, get=get))

    def zadd(self, key: str, mapping: dict[str, int]) -> None:
        assert key == "pw:holders" and list(mapping) == ["host-7-abcd"]
        self.calls.append(lambda: 1)

    def execute(self) -> list[Any]:
        return [call() for call in self.calls]


@pytest.fixture
def parts() -> tuple[Liveness, ScriptedRedis, Clock]:
    r, clock = ScriptedRedis(), Clock()
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
    live, r, clock = parts
    live.beat()
    clock.now += 0.5
    live.beat()
    assert live.current_epoch() == 1  # continuous: same epoch
    clock.now += 5.0  # SIGSTOP: the key expired meanwhile (as Redis would)
    r.key_exists = True  # even if the key were still there, the time alone is a gap
    live.beat()
    assert live.current_epoch() == 2 and not live.vouches(1)


def test_a_beat_that_finds_its_key_missing_starts_a_new_epoch(parts: Any) -> None:
    live, r, clock = parts
    live.beat()
    clock.now += 0.5
    r.key_exists = False  # FLUSHDB of the lock store
    live.beat()
    assert live.current_epoch() == 2 and not live.vouches(1)


def test_failed_beats_change_nothing_until_the_window_ends(parts: Any) -> None:
    live, r, clock = parts
    live.beat()
    r.down = True
    clock.now += 1.0
    assert not live.beat() and live.vouches(1)
    clock.now += 1.5
    assert not live.vouches(1)
    r.down = False
    assert live.beat() and live.current_epoch() == 2  # the gap is noticed on recovery


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
