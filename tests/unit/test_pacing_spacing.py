"""A lock holder's own spacing past its lease (gateway/pacing.py, ``Pacer._keep``): one
interval after the previous slot, never less than half an interval after the last use, so
short delays are made up and no span holds more requests than the quota allows: never more
than floor(rate) in any second, the protocol's "at most `rate` requests per second" read to
the letter (a delay was made up even when that put rate + 1 in a second, before)."""

from __future__ import annotations

import bisect
import itertools
import random

import pytest
import redis

from payment_worker.gateway.pacing import Pacer
from payment_worker.gateway.pacing_lease import WINDOW, Lease, next_free, spent, spent_by
from tests.fakes import FakeClock

RATE = 100.0
INTERVAL = 1.0 / RATE


def _uses(late: list[float], interval: float = INTERVAL) -> list[float]:
    """The moments a holder sends when it asks again as soon as its request is done (at
    once, here) and each wait for a slot ends late by the next of ``late`` (a sleep that
    overshoots, a core or the GIL taken by someone else)."""
    return _drive(Lease(interval, 0.0, 0.0, 0, used=1, last_use=-interval), late)


def _drive(lease: Lease, late: list[float], now: float = 0.0) -> list[float]:
    """``_uses`` on a given lease: its leased slots first (``Pacer._take``), then the
    holder's own spacing (``Pacer._keep``), from ``now``."""
    uses = []
    for delay in late:
        while True:
            wait = Pacer._take(lease, lease.interval, now)
            if wait is None:
                wait = Pacer._keep(lease, lease.interval, now)
            assert wait is not None
            if wait == 0:
                break
            now += wait + delay
            delay = 0.0  # late once per wait; asked again at once (another wait: on time)
        uses.append(now)
    return uses


def _most_in_any_span(times: list[float], span: float) -> int:
    return max(bisect.bisect_right(times, t + span + 1e-12) - i for i, t in enumerate(times))


def test_delays_shorter_than_half_an_interval_are_made_up() -> None:
    # every use 3 ms late on a 10 ms interval: spaced from the last use this was 77 per second
    uses = _uses([0.003] * 1000)
    assert uses[1] - uses[0] == pytest.approx(INTERVAL + 0.003)  # the first delay is not
    rate = (len(uses) - 1) / (uses[-1] - uses[0])
    # (a second counted 2 % long: the quota's share of it)
    assert rate == pytest.approx(RATE / WINDOW, rel=0.01)


def test_a_long_delay_is_made_up_by_half_an_interval_at_most() -> None:
    uses = _uses([0.0, 0.0, 0.050, 0.0, 0.0])
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(uses)]
    # 50 ms late: the next use may come half an interval later, then the spacing is whole
    assert gaps == pytest.approx([INTERVAL, INTERVAL + 0.050, INTERVAL / 2, INTERVAL])


@pytest.mark.parametrize("seed", range(20))
def test_random_delays_never_crowd_a_span(seed: int) -> None:
    rng = random.Random(seed)
    delays = [
        rng.choice([0.0, rng.uniform(0, INTERVAL), rng.uniform(0, 5 * INTERVAL)])
        for _ in range(2000)
    ]
    uses = _uses(delays)
    assert min(b - a for a, b in itertools.pairwise(uses)) >= INTERVAL / 2 - 1e-9
    for span in (0.05, 0.2):
        # never more than the quota's share of the span plus one and a half requests
        assert _most_in_any_span(uses, span) <= int(RATE * span + 1.5 + 1e-9)
    # and never more than the quota in a second, a closed one included (rate + 1 before)
    assert _most_in_any_span(uses, 1.0) <= RATE


@pytest.mark.parametrize("late", ["tiny", "small", "3ms"])
@pytest.mark.parametrize("seed", range(5))
def test_short_delays_made_up_never_put_rate_plus_one_in_a_second(late: str, seed: int) -> None:
    """A thread that wakes a little late now and then (the common case): each delay made up
    in full put rate + 1 in some second (in every seed, before); now the holder still keeps
    more than 97 % of the quota (a second is counted 2 % long), where spacing from each use
    kept 77 % at 3 ms late."""
    rng = random.Random(seed)
    pick = {
        "tiny": lambda: rng.uniform(0, 0.0005),
        "small": lambda: rng.choice([0.0] * 5 + [rng.uniform(0, INTERVAL / 2)]),
        "3ms": lambda: 0.003,
    }[late]
    uses = _uses([pick() for _ in range(2000)])
    assert _most_in_any_span(uses, 1.0) <= RATE
    assert (len(uses) - 1) / (uses[-1] - uses[0]) > 0.97 * RATE


@pytest.mark.parametrize("rate", [1.0, 2.5, 20.0, 33.3])
@pytest.mark.parametrize("seed", range(5))
def test_leased_slots_then_own_spacing_keep_floor_rate_in_any_second(
    rate: float, seed: int
) -> None:
    """A lease's slots (spaced from each use) and then the holder's own spacing: a quota
    that is not a whole number allows its whole part in a second (one request per interval
    alone put 3 in a second at 2.5/s)."""
    rng = random.Random(seed)
    interval = 1.0 / rate
    lease = Lease(interval, next_at=0.0, end=10 * interval, left=10)
    delays = [rng.choice([0.0, rng.uniform(0, interval), 0.001]) for _ in range(300)]
    uses = _drive(lease, delays)
    assert lease.kept  # the lease was spent, then the holder went on on its own
    assert _most_in_any_span(uses, 1.0) <= max(1, int(rate))


def test_a_lease_matters_until_its_last_use_is_an_interval_back() -> None:
    """A process sweeps (or a drain's start replaces) only leases that no longer space the
    next request: one swept at its next slot, half an interval after a late use, would let
    a fresh lease from Redis send then."""
    uses = _uses([0.0, 0.0, 0.050])  # the last use 50 ms late: its next slot half an interval on
    lease = Lease(INTERVAL, next_at=0.0, end=0.0, left=0, used=1, last_use=-INTERVAL)
    for at in uses:
        assert Pacer._keep(lease, INTERVAL, at) == 0.0
    assert lease.next_at == pytest.approx(uses[-1] + INTERVAL / 2)
    # (and the time a second is counted longer: a next holder an interval on, at the
    # quota, would send its hundredth request a second after this one)
    assert spent_by(lease) == pytest.approx(uses[-1] + INTERVAL + (WINDOW - 1))


@pytest.mark.parametrize("rate", [3.0, 10.0, 100.0])
@pytest.mark.parametrize("seed", range(10))
def test_a_next_holder_from_next_free_keeps_the_quota_with_the_last_one(
    rate: float, seed: int
) -> None:
    """The give-back (``Pacer.returned``) sets the account's next free slot to
    ``next_free``: a next holder in another process, which knows nothing of this one's
    requests and sends one per interval from then, keeps both holders' requests together
    at floor(rate) in any second, however the last one's requests bunched."""
    rng = random.Random(seed)
    interval = 1.0 / rate
    lease = Lease(interval, 0.0, 0.0, 0, used=1, last_use=-interval)
    # a holder made late now and then, making its delays up: its last second is dense
    before = _drive(lease, [rng.choice([0.0, 0.0, 3 * interval]) for _ in range(int(rate) * 3)])
    start = max(next_free(lease), before[-1])
    assert start >= before[-1] + interval - 1e-9
    nxt = Lease(interval, start, start + 5.0, int(rate) * 5)
    after = _drive(nxt, [rng.choice([0.0, interval / 3]) for _ in range(int(rate) * 2)], start)
    assert _most_in_any_span(before + after, 1.0) <= int(rate)


def test_a_sweep_reads_the_uses_only_while_they_still_space_the_next() -> None:
    lease = Lease(INTERVAL, next_at=0.0, end=0.0, left=0, used=1, last_use=-INTERVAL)
    uses = _drive(lease, [0.0] * 150)  # a second and a half at the quota
    last = uses[-1]
    # not before the last second's first use is a second back, nor later than a second
    # after the last use
    assert uses[-100] + WINDOW <= spent_by(lease) <= last + WINDOW
    assert not spent(lease, spent_by(lease) - 1e-6)
    assert spent(lease, spent_by(lease) + 1e-6)
    assert spent(lease, last + WINDOW + 0.001)


def _held_pacer(clock: FakeClock, lease: Lease) -> Pacer:
    """A pacer holding ``lease`` of account "a" (no Redis command is sent here)."""
    pacer = Pacer(redis.Redis(), lease_seconds=0.5, clock=clock)
    lease.tat = b"123.000"
    pacer._leases["a"] = lease
    return pacer


def test_the_give_back_leaves_room_for_the_last_seconds_requests() -> None:
    """A holder that made a delay up sent a second's worth of requests in less than a
    second, one of them late: an interval after its last one, a next holder sending at the
    quota would put rate + 1 in the second after the late one. The give-back names the slot
    from which it cannot."""
    clock = FakeClock()
    lease = Lease(INTERVAL, next_at=0.0, end=0.0, left=0, used=1, last_use=-INTERVAL)
    uses = _drive(lease, [0.0] * 10 + [0.0049] + [0.0] * 89)  # late once, then made up
    assert uses[-1] - uses[0] < 1.0 and len(uses) == RATE
    clock.now = uses[-1]
    given = _held_pacer(clock, lease).returned("a")
    assert given is not None and given[0] == b"123.000"
    assert given[1] == pytest.approx((next_free(lease) - uses[-1]) * 1000)
    # more than the interval alone would give: the request made late still counts
    assert given[1] > INTERVAL * 1000 * 1.5
    old = [clock.now + (j + 1) * INTERVAL for j in range(100)]  # an interval on, as before
    assert _most_in_any_span(uses + old, 1.0) == RATE + 1
    start = clock.now + given[1] / 1000
    after = [start + j * INTERVAL for j in range(100)]  # the next holder, at the quota
    assert _most_in_any_span(uses + after, 1.0) <= RATE


def test_the_give_back_is_an_interval_when_the_last_second_leaves_room() -> None:
    clock = FakeClock()
    lease = Lease(INTERVAL, next_at=0.0, end=0.0, left=0, used=1, last_use=-INTERVAL)
    uses = _drive(lease, [0.0, 0.0, 0.0])  # three requests: the second has room
    # (the last one's own second: a next holder an interval and the margin after it)
    clock.now = uses[-1] + (WINDOW - 1) + INTERVAL / 2
    given = _held_pacer(clock, lease).returned("a")
    assert given is not None and given[1] == pytest.approx(INTERVAL * 1000)
    # an interval after the last one (and the time a second is counted longer): nothing
    # to give, the stored timeline is past it
    lease = Lease(INTERVAL, next_at=0.0, end=0.0, left=0, used=1, last_use=-INTERVAL)
    uses = _drive(lease, [0.0, 0.0, 0.0])
    clock.now = uses[-1] + INTERVAL + (WINDOW - 1) + 0.0001
    assert _held_pacer(clock, lease).returned("a") is None
