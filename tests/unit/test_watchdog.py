"""The watchdog's stall rule (locks/watchdog.py, locks/account_lock.py), without Redis.

A holder that reports no progress for ``max_stall`` seconds is blocked somewhere; the
watchdog then stops renewing its lock (lost, reason ``stalled``) instead of keeping the
account from everyone for as long as the holder stays blocked.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import sqlalchemy
from prometheus_client import REGISTRY

from payment_worker.errors import LockLost
from payment_worker.locks import account_lock
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.watchdog import Lease, Renewer, StallRule
from tests.fakes import FakeClock


def test_silence_up_to_the_bound_is_no_stall_then_it_is() -> None:
    clock = FakeClock()
    rule = StallRule(10.0, clock)
    clock.sleep(9.9)
    assert rule.stalled_for() is None
    clock.sleep(0.1)
    assert rule.stalled_for() == pytest.approx(10.0)
    rule.touch()  # progress: the count starts again
    assert rule.stalled_for() is None
    clock.sleep(25.0)
    assert rule.stalled_for() == pytest.approx(25.0)


def test_the_rule_can_be_off_and_refuses_a_bound_of_zero() -> None:
    clock = FakeClock()
    off = StallRule(None, clock)
    clock.sleep(1e9)
    assert off.stalled_for() is None
    with pytest.raises(ValueError):
        StallRule(0.0, clock)


class Renewals:
    """Stands in for the renewal round trip: answers ``answer`` per lock and counts batches."""

    def __init__(self) -> None:
        self.calls = 0  # renewals sent
        self.batches: list[list[str]] = []
        self.answer: object = 1
        self.during: list[Any] = []  # callables run while the batch is "in flight"

    def __call__(self, batch: list[Lease]) -> list[object]:
        self.calls += len(batch)
        self.batches.append([lease.key for lease in batch])
        for action in self.during:
            action()
        if isinstance(self.answer, Exception):
            raise self.answer
        return [self.answer] * len(batch)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A fake clock, also the locks' own: deadlines and renewals read the same time."""
    fake = FakeClock()
    monkeypatch.setattr(account_lock, "_clock", fake)
    return fake


def _renewer(clock: FakeClock) -> tuple[Renewer, Renewals]:
    # no thread: the test drives tick() on a clock it moves; the client never connects
    renewer = Renewer(redis.Redis(port=1), clock=clock, threaded=False)
    renew = Renewals()
    renewer.renew_many = renew  # type: ignore[method-assign]
    return renewer, renew


def _held_lock(
    clock: FakeClock,
    reasons: list[str],
    renewer: Renewer,
    account: str = "acct-1",
    deadline: float = float("inf"),
) -> AccountLock:
    lock = AccountLock(
        redis.Redis(port=1),
        account,
        engine=sqlalchemy.create_engine("postgresql+psycopg://u@127.0.0.1:1/none"),
        ttl_ms=3000,
        safety_margin_ms=100,
        on_lost=reasons.append,
        max_stall=10.0,
        renewer=renewer,
    )
    lock._stall = StallRule(10.0, clock)  # the rule on a clock the test moves
    # as acquire() leaves it
    with lock._state:
        lock._token = "tok"
        lock.fence_token = 7
        lock._deadline = deadline
        lock._start_renewal("tok")
    return lock


def test_a_holder_that_reports_progress_keeps_its_lock(clock: FakeClock) -> None:
    reasons: list[str] = []
    renewer, renew = _renewer(clock)
    lock = _held_lock(clock, reasons, renewer)
    for _ in range(30):  # 30 ticks of one second: three times the bound
        clock.sleep(1.0)
        lock.progress()
        assert renewer.tick() == 1.0  # renewed, next tick at TTL/3
    assert renew.calls == 30 and reasons == [] and lock.lost_reason is None
    lock.ensure_held()


def test_a_silent_holder_loses_its_lock_and_it_is_not_renewed(clock: FakeClock) -> None:
    reasons: list[str] = []
    renewer, renew = _renewer(clock)
    lock = _held_lock(clock, reasons, renewer)
    before = (
        REGISTRY.get_sample_value("payment_worker_lock_lost_total", {"reason": "stalled"}) or 0.0
    )
    clock.sleep(9.0)
    assert renewer.tick() == 1.0 and renew.calls == 1  # not yet: renewed
    clock.sleep(1.0)  # ten seconds without a word (blocked in a statement, a hung call)
    assert renewer.tick() is None  # nothing left to renew
    assert renew.calls == 1  # and it did not renew: the key expires within one TTL
    assert lock.lost_reason == "stalled" and reasons == ["stalled"]
    assert (
        REGISTRY.get_sample_value("payment_worker_lock_lost_total", {"reason": "stalled"})
        == before + 1
    )
    # once lost, always lost: progress reported afterwards changes nothing
    lock.progress()
    with pytest.raises(LockLost, match="stalled"):
        lock.ensure_held()
    clock.sleep(1.0)
    assert renewer.tick() is None and renew.calls == 1 and len(renewer) == 0


def test_locks_due_together_share_one_round_trip(clock: FakeClock) -> None:
    reasons: list[str] = []
    renewer, renew = _renewer(clock)
    a = _held_lock(clock, reasons, renewer, "a")
    clock.sleep(0.05)  # within a tenth of the interval: renewed in the same batch as a
    b = _held_lock(clock, reasons, renewer, "b")
    clock.sleep(0.45)
    c = _held_lock(clock, reasons, renewer, "c")  # half an interval later: its own batch
    clock.sleep(0.5)  # a is due
    assert renewer.tick() == pytest.approx(0.5)  # c is due in half a second
    assert renew.batches == [[a.key, b.key]]
    clock.sleep(0.5)
    renewer.tick()
    assert renew.batches[-1] == [c.key]
    # 30 more intervals: one batch per interval for a and b, one for c; never more
    for _ in range(60):
        clock.sleep(0.5)
        for lock in (a, b, c):
            lock.progress()
        renewer.tick()
    assert len(renew.batches) == 2 + 60
    assert renew.calls == 3 + 30 * 3 and reasons == []


def test_a_release_during_the_round_trip_discards_the_answer(clock: FakeClock) -> None:
    reasons: list[str] = []
    renewer, renew = _renewer(clock)
    a = _held_lock(clock, reasons, renewer, "a")
    b = _held_lock(clock, reasons, renewer, "b")
    lease_b = b._lease
    assert lease_b is not None
    # b is released while the batch is in flight (release's own Redis call is not the point)
    renew.during.append(lambda: (renewer.remove(lease_b), setattr(b, "_token", None)))
    renew.answer = 0  # "gone": for b that is the answer about a released lock
    clock.sleep(1.0)
    renewer.tick()
    assert a.lost_reason == "expired" and reasons == ["expired"]  # a: lost, signalled
    assert b.lost_reason is None  # b: released, its answer ignored, not "lost"
    renew.during.clear()
    clock.sleep(1.0)
    assert renewer.tick() is None and renew.calls == 2  # neither renewed again


def test_redis_unreachable_retries_sooner_then_marks_lost_at_the_deadline(
    clock: FakeClock,
) -> None:
    reasons: list[str] = []
    renewer, renew = _renewer(clock)
    lock = _held_lock(clock, reasons, renewer, deadline=clock() + 2.9)  # TTL - margin
    renew.answer = redis.exceptions.ConnectionError("refused")
    clock.sleep(1.0)
    assert renewer.tick() == pytest.approx(0.95)  # min(TTL/3, 1.9 s left / 2)
    steps = 1
    while lock.lost_reason is None:
        lock.progress()
        delay = renewer.tick()
        if delay is None:
            break
        clock.sleep(delay)
        steps += 1
        assert steps < 30
    assert lock.lost_reason == "unreachable" and reasons == ["unreachable"]
    assert clock() >= 1000.0 + 2.9  # never before the local deadline
    assert len(renewer) == 0
