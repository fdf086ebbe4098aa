"""A drain loop wired to the in-memory fakes of :mod:`tests.fakes`, for the unit tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from payment_worker.domain.retry import Backoff
from payment_worker.domain.transitions import Policy
from payment_worker.worker.drain import Drainer, DrainLimits
from tests.fakes import FakeClock, FakeGateway, FakeLock, FakeQueue, FakeStore

ACCT = "acct-1"


@dataclass
class World:
    clock: FakeClock
    store: FakeStore
    gateway: FakeGateway
    queue: FakeQueue
    holders: dict[str, FakeLock] = field(default_factory=dict)
    locks: list[FakeLock] = field(default_factory=list)
    chunk_size: int = 5
    max_seconds: float = 60.0
    hold_wait: float = 5.0
    max_attempts: int = 3
    in_doubt_max: float = 3600.0
    key_trust: float = 77760.0
    stopping: list[bool] = field(default_factory=lambda: [False])  # a warm shutdown began

    @classmethod
    def fresh(cls) -> World:
        """A world on a new clock, with an empty store, gateway and queue."""
        clock = FakeClock()
        return cls(clock, FakeStore(clock), FakeGateway(), FakeQueue())

    def lock_for(self, account_id: str) -> FakeLock:
        lock = FakeLock(account_id, self.store, self.holders, self.queue.marks)
        self.locks.append(lock)
        return lock

    def drainer(self) -> Drainer:
        return Drainer(
            open_store=self.store.open,
            lock_for=self.lock_for,
            gateway=self.gateway,
            queue=self.queue,
            policy=Policy(
                max_attempts=self.max_attempts,
                backoff=Backoff(base=1.0, cap=4.0),
                lookup_backoff=Backoff(base=1.0, cap=4.0),
                retry_after_max=300.0,
                in_doubt_max=self.in_doubt_max,
                key_trust=self.key_trust,
            ),
            limits=DrainLimits(self.chunk_size, self.max_seconds, self.hold_wait),
            clock=self.clock,
            sleep=self.clock.sleep,
            stopping=lambda: self.stopping[0],
        )

    def run(self, batch_id: str = "batch-1") -> object:
        return self.drainer().run_account(ACCT, batch_id)

    def run_until_settled(self, limit: int = 1000) -> None:
        """Run, and run again when each delayed message comes due, until nothing is open."""
        for _ in range(limit):
            before = len(self.queue.scheduled) + len(self.queue.handed_off)
            self.run()
            if self.store.seconds_until_next_due(ACCT) is None:
                return
            if len(self.queue.scheduled) + len(self.queue.handed_off) == before:
                return
            if len(self.queue.scheduled) > 0 and self.queue.scheduled[-1][2] > 0:
                self.clock.sleep(self.queue.scheduled[-1][2])
        raise AssertionError("did not settle")
