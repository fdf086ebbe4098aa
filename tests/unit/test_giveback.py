"""The give-back queue's rules on a fake clock (payment_worker.locks.giveback): a failed try
comes back later with a doubling pause, the first failure of a pass puts the rest off without
trying them, and an entry past its lock's TTL is dropped. The real Redis side is in
tests/integration/test_lost_replies.py."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError

from payment_worker.locks.giveback import FIRST_DELAY, MAX_DELAY, GiveBack
from tests.fakes import FakeClock


class Attempt:
    """A release that fails while ``down`` and answers ``code`` otherwise."""

    def __init__(self, code: int = 1) -> None:
        self.code = code
        self.down = False
        self.calls: list[float] = []

    def __call__(self, clock: FakeClock) -> int:
        self.calls.append(clock.now)
        if self.down:
            raise RedisConnectionError("refused")
        return self.code


def _queue(clock: FakeClock, *attempts: Attempt, ttl_s: float = 30.0) -> GiveBack:
    gb = GiveBack(clock=clock, threaded=False)
    for i, a in enumerate(attempts):
        gb.add(f"acct-{i}", lambda a=a: a(clock), ttl_s)
    return gb


def test_an_entry_waits_for_its_first_pause_then_goes_through() -> None:
    clock, attempt = FakeClock(), Attempt()
    gb = _queue(clock, attempt)
    gb.run_due()
    assert attempt.calls == [] and len(gb) == 1  # not due yet
    clock.now += FIRST_DELAY
    gb.run_due()
    assert attempt.calls == [clock.now] and len(gb) == 0


def test_failures_come_back_with_a_doubling_pause_up_to_the_cap() -> None:
    clock, attempt = FakeClock(), Attempt()
    attempt.down = True
    gb = _queue(clock, attempt)
    gaps = []
    for _ in range(8):
        clock.now += 2.0  # past any pause: every pass tries it
        before = len(attempt.calls)
        gb.run_due()
        assert len(attempt.calls) == before + 1
        gaps.append(round(gb._pending[0].due - clock.now, 3))
    assert gaps[:4] == [FIRST_DELAY, FIRST_DELAY * 2, FIRST_DELAY * 4, FIRST_DELAY * 8]
    assert max(gaps) == MAX_DELAY
    attempt.down = False
    clock.now += MAX_DELAY
    gb.run_due()
    assert len(gb) == 0


def test_the_first_failure_of_a_pass_puts_the_rest_off_untried() -> None:
    clock = FakeClock()
    first, second = Attempt(), Attempt()
    first.down = True
    gb = _queue(clock, first, second)
    clock.now += FIRST_DELAY
    gb.run_due()
    assert len(first.calls) == 1 and second.calls == []  # a hung Redis costs one timeout
    assert len(gb) == 2


def test_an_entry_past_its_locks_ttl_is_dropped() -> None:
    clock, attempt = FakeClock(), Attempt()
    attempt.down = True
    start = clock.now
    gb = _queue(clock, attempt, ttl_s=1.0)
    while len(gb):
        clock.now += 0.3
        gb.run_due()
    # tried until the TTL was about to run out, never after it
    assert attempt.calls and max(attempt.calls) < start + 1.0


def test_an_answer_that_is_not_ours_ends_the_entry() -> None:
    clock, attempt = FakeClock(), Attempt(code=-1)  # the lock holds another value now
    gb = _queue(clock, attempt)
    clock.now += FIRST_DELAY
    gb.run_due()
    assert len(attempt.calls) == 1 and len(gb) == 0
