"""A lock holder's own spacing past its lease (gateway/pacing.py, ``Pacer._keep``): one
interval after the previous slot, never less than half an interval after the last use, so
short delays are made up and no span holds more requests than the quota allows."""

from __future__ import annotations

import bisect
import itertools
import random

import pytest

from payment_worker.gateway.pacing import Pacer, _Lease, _spent_by

RATE = 100.0
INTERVAL = 1.0 / RATE


def _uses(late: list[float]) -> list[float]:
    """The moments a holder sends when it asks again as soon as its request is done (at
    once, here) and each wait for a slot ends late by the next of ``late`` (a sleep that
    overshoots, a core or the GIL taken by someone else)."""
    lease = _Lease(INTERVAL, next_at=0.0, end=0.0, left=0, used=1, last_use=-INTERVAL)
    now, uses = 0.0, []
    for delay in late:
        wait = Pacer._keep(lease, INTERVAL, now)
        assert wait is not None
        if wait > 0:
            now += wait + delay
            assert Pacer._keep(lease, INTERVAL, now) == 0.0
        uses.append(now)
    return uses


def _most_in_any_span(times: list[float], span: float) -> int:
    return max(bisect.bisect_right(times, t + span + 1e-12) - i for i, t in enumerate(times))


def test_delays_shorter_than_half_an_interval_are_made_up() -> None:
    # every use 3 ms late on a 10 ms interval: spaced from the last use this was 77 per second
    uses = _uses([0.003] * 1000)
    assert uses[1] - uses[0] == pytest.approx(INTERVAL + 0.003)  # the first delay is not
    rate = (len(uses) - 1) / (uses[-1] - uses[0])
    assert rate == pytest.approx(RATE, rel=0.01)


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
    for span in (0.05, 0.2, 1.0):
        # never more than the quota's share of the span plus one and a half requests
        assert _most_in_any_span(uses, span) <= int(RATE * span + 1.5 + 1e-9)


def test_a_lease_matters_until_its_last_use_is_an_interval_back() -> None:
    """A process sweeps (or a drain's start replaces) only leases that no longer space the
    next request: one swept at its next slot, half an interval after a late use, would let
    a fresh lease from Redis send then."""
    uses = _uses([0.0, 0.0, 0.050])  # the last use 50 ms late: its next slot half an interval on
    lease = _Lease(INTERVAL, next_at=0.0, end=0.0, left=0, used=1, last_use=-INTERVAL)
    for at in uses:
        assert Pacer._keep(lease, INTERVAL, at) == 0.0
    assert lease.next_at == pytest.approx(uses[-1] + INTERVAL / 2)
    assert _spent_by(lease) == pytest.approx(uses[-1] + INTERVAL)
