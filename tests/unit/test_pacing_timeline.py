"""A whole ``Pacer`` on a fake clock: its lease script answered by a model of
``lua/pace_acquire.lua`` on that same clock (the Redis server's clock cannot be made to
jump), so that every moment a request is let go is exact and the quota can be checked to
the letter: never more than floor(rate) requests of a holder in any second, whatever
happens to its lease in between (a sweep, a lease refused for being too far ahead, a
cooldown, a rate that changes). The real script, on a real Redis, is exercised by
``tests/integration/test_pacing_leases.py``."""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from payment_worker.gateway.pacing import Pacer
from tests.fakes import FakeClock

ACCOUNT = "acct"


class _Timeline:
    """``pace_acquire.lua``'s rules for one account, on the fake clock (ms)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.tat: float | None = None
        self.until = 0.0

    def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        rate, want, ahead_ms = float(args[0]), int(args[1]), float(args[2])
        now = self.clock.now * 1000
        interval = 1000 / rate
        start = self.tat if self.tat is not None else now
        if self.until > 0 and start < self.until + interval:
            start = self.until + interval
        start = max(start, now)
        if start - now > ahead_ms:
            return [0, max(1, math.ceil(start - now - ahead_ms)), math.ceil(start - now)]
        self.tat = start + want * interval
        return [want, f"{start - now:.3f}", f"{self.tat:.3f}".encode()]

    def cooldown(self, keys: Sequence[str], args: Sequence[Any]) -> int:
        until = self.clock.now * 1000 + int(args[0])
        self.until = max(self.until, until)
        return int(self.until - self.clock.now * 1000)


def _pacer(clock: FakeClock, lease_seconds: float) -> tuple[Pacer, _Timeline]:
    pacer = Pacer(redis.Redis(), lease_seconds=lease_seconds, clock=clock)  # sends nothing
    timeline = _Timeline(clock)
    pacer._acquire = timeline  # type: ignore[assignment]
    pacer._cooldown = timeline.cooldown  # type: ignore[assignment]
    return pacer, timeline


def _most_in_a_second(times: list[float]) -> int:
    times = sorted(times)
    return max(bisect.bisect_right(times, t + 1.0 + 1e-12) - i for i, t in enumerate(times))


def _holder(
    seed: int, rate: float, lease_seconds: float, *, events: bool, requests: int = 400
) -> list[float]:
    """The moments a lock holder's requests leave: it asks again as soon as it may, each
    wake-up late by a little now and then; with ``events``, other accounts' leases sweep
    this process's (as a process with 1,024 of them or more does now and then), and a wait
    for a slot gives up when the slot is further ahead than it would wait (``ahead``)."""
    rng = random.Random(seed)
    clock = FakeClock()
    pacer, _ = _pacer(clock, lease_seconds)
    uses: list[float] = []
    while len(uses) < requests:
        if events and rng.random() < 0.2:
            pacer._sweep(clock.now)
        ahead = rng.choice([None, None, 0.0, 0.05]) if events else None
        wait = pacer.try_acquire(ACCOUNT, rate, ahead, held=True)
        if wait == 0:
            uses.append(clock.now)
            wait = rng.choice([0.0, 0.0, 0.0005, 0.003])  # the request, at zero latency
        clock.now += wait + rng.choice([0.0, 0.0, 0.0002, 0.004])
    return uses


@pytest.mark.parametrize("rate", [0.5, 2.5, 3.0, 20.0, 33.3, 100.0])
@pytest.mark.parametrize("seed", range(4))
def test_a_holder_keeps_floor_rate_in_any_second_whatever_befalls_its_lease(
    rate: float, seed: int
) -> None:
    """Below 4/s a lease is one slot (0.5 s leases), so every request goes through a lease
    that may be swept or refused; a sweep once dropped a lease whose uses still counted (a
    review found it), and a refused lease dropped them too."""
    uses = _holder(seed, rate, 0.5, events=True, requests=120 if rate < 5 else 400)
    assert _most_in_a_second(uses) <= max(1, int(rate + 1e-9))
    steady = _holder(seed, rate, 0.5, events=False, requests=120 if rate < 5 else 400)
    assert _most_in_a_second(steady) <= max(1, int(rate + 1e-9))


@pytest.mark.parametrize(("high", "low"), [(100.0, 50.0), (20.0, 3.0), (6.0, 2.5)])
def test_a_rate_lowered_mid_drain_counts_the_requests_sent_at_the_higher_one(
    high: float, low: float
) -> None:
    """``GATEWAY_RATE_OVERRIDES`` lowered while a holder sends: every request at the new
    rate leaves with no more than floor(low) in the second it ends, those sent at the old
    rate included (the newest of them are kept, as many as the new rate counts)."""
    clock = FakeClock()
    pacer, _ = _pacer(clock, 0.5)
    sent: list[tuple[float, float]] = []  # (when, at which rate)
    for rate in (high, low):
        for _ in range(int(high) * 2):
            while (wait := pacer.try_acquire(ACCOUNT, rate, held=True)) > 0:
                clock.now += wait
            sent.append((clock.now, rate))
            clock.now += 0.0005
    times = [t for t, _ in sent]
    for t, rate in sent:
        if rate == low:
            # the requests in the second that ends with this one
            inside = bisect.bisect_right(times, t) - bisect.bisect_right(times, t - 1.0)
            assert inside <= int(low), (t, inside)


@pytest.mark.parametrize("rate", [0.5, 2.5, 3.0, 33.3, 100.0])
@pytest.mark.parametrize("seed", range(4))
def test_sweeps_and_refused_leases_keep_the_last_second(rate: float, seed: int) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    pacer, _ = _pacer(clock, 0.5)
    uses: list[float] = []
    while len(uses) < (100 if rate < 5 else 300):
        pacer._sweep(clock.now)  # every time: nothing that still counts may go
        wait = pacer.try_acquire(ACCOUNT, rate, rng.choice([None, 0.0, 0.01]), held=True)
        if wait == 0:
            uses.append(clock.now)
        clock.now += wait + rng.choice([0.0, 0.0002, 0.004])
    assert _most_in_a_second(uses) <= max(1, int(rate + 1e-9))


@pytest.mark.parametrize("seed", range(4))
def test_a_short_cooldown_keeps_the_last_second(seed: int) -> None:
    """A 429's Retry-After shorter than a second: the requests before it still count."""
    rng = random.Random(seed)
    clock = FakeClock()
    pacer, _ = _pacer(clock, 0.5)
    rate = 50.0
    uses: list[float] = []
    while len(uses) < 300:
        if rng.random() < 0.01:
            pacer.cooldown(ACCOUNT, rng.choice([0.05, 0.2]))
        wait = pacer.try_acquire(ACCOUNT, rate, held=True)
        if wait == 0:
            uses.append(clock.now)
        clock.now += wait + rng.choice([0.0, 0.0002, 0.004])
    assert _most_in_a_second(uses) <= int(rate)


def test_a_start_answer_it_cannot_read_keeps_the_last_uses() -> None:
    """The lock's take hands its pacing answer to ``Pacer.started``; one it cannot read
    (raised, and logged by the caller) must not drop the uses that still count."""
    clock = FakeClock()
    pacer, _ = _pacer(clock, 0.5)
    for _ in range(3):
        assert pacer.try_acquire(ACCOUNT, 10.0, held=True) == 0.0
        clock.now += 0.1
    with pytest.raises((IndexError, ValueError)):
        pacer.started(ACCOUNT, 10.0, [1], clock.now)
    kept = pacer._leases[ACCOUNT]
    assert len(kept.recent) == 3 and kept.left == 0  # its uses, no slot
