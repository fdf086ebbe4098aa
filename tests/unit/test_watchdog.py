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
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.watchdog import StallRule
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
    """Stands in for the renewal script: answers 1 (renewed) and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, keys: list[str], args: list[Any]) -> int:
        self.calls += 1
        return 1


def _held_lock(clock: FakeClock, reasons: list[str]) -> tuple[AccountLock, Renewals]:
    # neither client connects: registering a script sends nothing, and the renewal is faked
    lock = AccountLock(
        redis.Redis(port=1),
        "acct-1",
        engine=sqlalchemy.create_engine("postgresql+psycopg://u@127.0.0.1:1/none"),
        ttl_ms=3000,
        safety_margin_ms=100,
        on_lost=reasons.append,
        max_stall=10.0,
    )
    renew = Renewals()
    lock._renew = renew  # type: ignore[assignment]
    lock._stall = StallRule(10.0, clock)  # the rule on a clock the test moves
    # as acquire() leaves it (minus the watchdog thread, driven by hand below)
    lock._token = "tok"
    lock.fence_token = 7
    lock._deadline = float("inf")
    return lock, renew


def test_a_holder_that_reports_progress_keeps_its_lock() -> None:
    clock, reasons = FakeClock(), []
    lock, renew = _held_lock(clock, reasons)
    for _ in range(30):  # 30 ticks of one second: three times the bound
        clock.sleep(1.0)
        lock.progress()
        assert lock._renew_tick("tok") == 1.0  # renewed, next tick at TTL/3
    assert renew.calls == 30 and reasons == [] and lock.lost_reason is None
    lock.ensure_held()


def test_a_silent_holder_loses_its_lock_and_it_is_not_renewed() -> None:
    clock, reasons = FakeClock(), []
    lock, renew = _held_lock(clock, reasons)
    before = REGISTRY.get_sample_value("payment_worker_lock_lost_total", {"reason": "stalled"}) or 0.0
    clock.sleep(9.0)
    assert lock._renew_tick("tok") == 1.0 and renew.calls == 1  # not yet: renewed
    clock.sleep(1.0)  # ten seconds without a word (blocked in a statement, a hung call)
    assert lock._renew_tick("tok") is None  # the watchdog stops
    assert renew.calls == 1  # and it did not renew: the key expires within one TTL
    assert lock.lost_reason == "stalled" and reasons == ["stalled"]
    assert REGISTRY.get_sample_value("payment_worker_lock_lost_total", {"reason": "stalled"}) == before + 1
    # once lost, always lost: progress reported afterwards changes nothing
    lock.progress()
    with pytest.raises(LockLost, match="stalled"):
        lock.ensure_held()
    assert lock._renew_tick("tok") is None and renew.calls == 1
