"""In-memory stand-ins for the drain loop's ports (payment_worker/worker/ports.py).

They keep the rules the real adapters keep, so a unit test of the loop means something:

* :class:`FakeStore` claims like db/work.py (pending/retryable -> dispatching with attempts + 1,
  a crashed holder's dispatching -> unknown, only due items, batch order), writes only over
  dispatching/unknown rows (terminal rows never move back), and rejects a stale fencing token
  with FencedOut;
* :class:`FakeLock` hands out a growing fencing token per acquisition, can be made lost and
  records when the holder reported progress;
* :class:`FakeGateway` answers from a script per idempotency key, runs the guard right
  before every "send" as the real client does, and remembers what was paid;
* :class:`FakeClock` is the one clock of all of them: ``sleep`` advances it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from payment_worker.db.work import Claim, ClaimedItem
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.domain.statuses import (
    IN_DOUBT_TX_STATUSES,
    OPEN_TX_STATUSES,
    SENDABLE_TX_STATUSES,
    TERMINAL_TX_STATUSES,
    TxStatus,
)
from payment_worker.domain.transitions import Doubt, ItemOutcome
from payment_worker.errors import FencedOut, LockLost
from payment_worker.gateway.outcomes import GatewayResult, Outcome
from payment_worker.locks.arrival import Arrival, EndRider, Rider
from payment_worker.worker.ports import Guard


class FakeClock:
    """Monotonic seconds that move only when somebody sleeps (or a test advances them)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


@dataclass
class Row:
    """One transaction row."""

    id: int
    batch_pk: int
    account_id: str
    transaction_id: str
    amount: int
    status: TxStatus = TxStatus.PENDING
    attempts: int = 0
    lookups: int = 0
    due_at: float = 0.0
    payment_id: str | None = None
    error_class: str | None = None
    fingerprint_ok: bool = True
    dispatched_at: float | None = None
    doubt_since: float | None = None
    first_doubt_at: float | None = None  # never cleared (db.work: first_doubt_at)
    key_status: str | None = None
    beneficiary: dict[str, Any] = field(
        default_factory=lambda: {"bank_code": "014", "account_number": "1", "name": "B"}
    )

    @property
    def key(self) -> str:
        return f"key-{self.transaction_id}"

    def request(self) -> PaymentRequest:
        return PaymentRequest(
            self.account_id, self.transaction_id, self.amount, "IDR", self.beneficiary
        )


class FakeStore:
    """The rows of every account, the fencing tokens, batches and dead letters."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.rows: dict[int, Row] = {}
        self.fences: dict[str, int] = defaultdict(int)
        self.completed: list[int] = []
        self.dead_letters: list[tuple[int, str]] = []
        self.writes: list[list[ItemOutcome]] = []
        self.opened = 0
        self.finishes = 0  # complete_and_next_due calls (one statement each)
        self.claims = 0  # claim_due calls (one statement each)
        self.boundaries = 0  # record_and_claim calls (one statement each)
        self.locked: set[int] = set()  # rows another transaction holds: claims skip them
        self._ids = itertools.count(1)

    def add(self, account_id: str, batch_pk: int, n: int, **kw: Any) -> list[Row]:
        """``n`` pending rows of one batch; ``kw`` sets row fields."""
        rows = []
        for _ in range(n):
            i = next(self._ids)
            row = Row(i, batch_pk, account_id, f"tx-{i}", 100 + i, due_at=self.clock(), **kw)
            self.rows[i] = row
            rows.append(row)
        return rows

    def statuses(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.rows.values():
            out[str(r.status)] += 1
        return dict(out)

    @contextmanager
    def open(self) -> Iterator[FakeStore]:
        self.opened += 1
        yield self

    def _fence(self, account_id: str, token: int) -> None:
        if self.fences[account_id] != token:
            raise FencedOut(f"fencing token {token} of account {account_id} is not current")

    # --- the WorkStore port --------------------------------------------------------------
    def fence_and_claim(self, account_id: str, limit: int) -> Claim:
        self.fences[account_id] += 1
        token = self.fences[account_id]
        claimed = FakeStore.claim_due(self, account_id, token, limit)  # one statement
        claimed.fence_token = token
        return claimed

    def claim_due(self, account_id: str, token: int, limit: int) -> Claim:
        self.claims += 1
        return self._claim(account_id, token, limit, frozenset())

    def _claim(self, account_id: str, token: int, limit: int, skip: frozenset[int]) -> Claim:
        self._fence(account_id, token)
        due = sorted(
            (
                r
                for r in self.rows.values()
                if r.account_id == account_id
                and r.status in OPEN_TX_STATUSES
                and r.due_at <= self.clock()
                and r.id not in skip
                and r.id not in self.locked
            ),
            key=lambda r: (r.batch_pk, r.id),
        )
        claimed = Claim(more_due=len(due) > limit)
        due = due[:limit]
        now = self.clock()
        for r in due:
            if r.status in SENDABLE_TX_STATUSES:
                r.status, r.attempts = TxStatus.DISPATCHING, r.attempts + 1
            elif r.status is TxStatus.DISPATCHING:
                r.status = TxStatus.UNKNOWN  # a crashed holder's: maybe sent
                r.doubt_since = r.doubt_since or r.dispatched_at or 0.0
            if r.first_doubt_at is None and r.status is TxStatus.UNKNOWN:
                r.first_doubt_at = r.doubt_since  # the doubt as it was (db.work's claim)
            if r.status is TxStatus.UNKNOWN and r.doubt_since is None:
                r.doubt_since = now  # a replayed item claimed for a lookup
            r.dispatched_at = now
            req = r.request()
            claimed.append(
                ClaimedItem(
                    id=r.id,
                    batch_pk=r.batch_pk,
                    account_id=r.account_id,
                    transaction_id=r.transaction_id,
                    amount=r.amount,
                    currency="IDR",
                    beneficiary=r.beneficiary,
                    description=None,
                    idempotency_key=r.key,
                    status=r.status,
                    attempts=r.attempts,
                    lookups=r.lookups,
                    request_fingerprint=req.fingerprint() if r.fingerprint_ok else "changed",
                    doubt_age=None if r.doubt_since is None else now - r.doubt_since,
                    first_doubt_age=None if r.first_doubt_at is None else now - r.first_doubt_at,
                    key_status=r.key_status,
                )
            )
        return claimed

    def record_outcomes(self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]) -> int:
        self._fence(account_id, token)
        self.writes.append(list(outcomes))
        changed = 0
        for o in outcomes:
            r = self.rows[o.item_id]
            if r.status not in IN_DOUBT_TX_STATUSES:
                continue  # terminal (or reset) rows never move back
            d = o.decision
            r.status, r.attempts, r.lookups = d.status, o.attempts, o.lookups
            if d.doubt is Doubt.SINCE_DISPATCH:
                r.doubt_since = r.doubt_since if r.doubt_since is not None else r.dispatched_at
            elif d.doubt is Doubt.RESET_TO_DISPATCH:
                r.doubt_since = r.dispatched_at
            elif d.doubt is Doubt.CLEAR:
                r.doubt_since = None
            key = d.key_status or ("sent" if o.reached else None)
            r.key_status = str(key) if key else r.key_status
            r.due_at = self.clock() + max(d.delay, 0.0)
            r.payment_id = d.payment_id or r.payment_id
            r.error_class = d.error_class
            if d.status is TxStatus.DEAD and d.dead_reason:
                self.dead_letters.append((r.id, str(d.dead_reason)))
            changed += 1
        return changed

    def complete_batches(
        self, account_id: str, token: int, batch_pks: Sequence[int] | None = None
    ) -> list[str]:
        if self.fences[account_id] != token:
            return []  # like the SQL: a stale holder completes nothing
        pks = {r.batch_pk for r in self.rows.values() if r.account_id == account_id}
        if batch_pks is not None:
            pks &= set(batch_pks)
        done = []
        for pk in sorted(pks - set(self.completed)):
            rows = [r for r in self.rows.values() if r.batch_pk == pk]
            if all(r.status in TERMINAL_TX_STATUSES for r in rows):
                self.completed.append(pk)
                done.append(f"batch-{pk}")
        return done

    def record_and_finish(
        self, account_id: str, token: int, outcomes: Sequence[ItemOutcome]
    ) -> tuple[int, list[str], float | None]:
        self._fence(account_id, token)
        changed = self.record_outcomes(account_id, token, outcomes)
        return (changed, *self.complete_and_next_due(account_id, token))

    def record_and_claim(
        self,
        account_id: str,
        token: int,
        outcomes: Sequence[ItemOutcome],
        ended: Sequence[int],
        limit: int,
    ) -> tuple[int, list[str], Claim]:
        self._fence(account_id, token)
        self.boundaries += 1
        changed = self.record_outcomes(account_id, token, outcomes)
        done = self.complete_batches(account_id, token, ended)
        # like the SQL, whose snapshot still reads the recorded rows as claimed: none of
        # them is claimed again by this statement
        recorded = frozenset(o.item_id for o in outcomes)
        return changed, done, self._claim(account_id, token, limit, recorded)

    def complete_and_next_due(self, account_id: str, token: int) -> tuple[list[str], float | None]:
        self.finishes += 1
        self._fence(account_id, token)
        return self.complete_batches(account_id, token), self.seconds_until_next_due(account_id)

    def seconds_until_next_due(self, account_id: str) -> float | None:
        due = [
            r.due_at
            for r in self.rows.values()
            if r.account_id == account_id and r.status in OPEN_TX_STATUSES
        ]
        return None if not due else min(due) - self.clock()


class FakeLock:
    """An account lock shared through ``holders``; each acquisition issues a new token."""

    def __init__(
        self,
        account_id: str,
        store: FakeStore,
        holders: dict[str, FakeLock],
        marks: dict[str, str] | None = None,
    ) -> None:
        self.account_id = account_id
        # the Redis keys an Arrival writes (FakeQueue's marks): busy sets, taken clears
        self._marks = marks if marks is not None else {}
        self.fence_token: int | None = None
        self.marked: bool | None = None
        self.lost = False
        self.checks_left: int | None = None  # lose the lock after this many checks
        self.progress_at: list[float] = []  # the clock at each progress report
        self.released_with: list[EndRider | None] = []  # the rider of each release
        self._store = store
        self._holders = holders

    def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        arrival: Arrival | None = None,
        fence: bool = True,
        rider: Rider | None = None,
    ) -> bool:
        if self.account_id in self._holders:
            if arrival is not None:
                self._marks[arrival.mark] = arrival.value
            return False
        if arrival is not None:
            for key in (arrival.mark, *arrival.cleared):
                self._marks.pop(key, None)
        self._holders[self.account_id] = self
        self.fence_token = None
        if fence:
            self._store.fences[self.account_id] += 1
            self.fence_token = self._store.fences[self.account_id]
        return True

    def adopt_fence(self, token: int) -> None:
        self.fence_token = token

    def ensure_held(self) -> None:
        if self.checks_left is not None:
            if self.checks_left <= 0:
                self.lost = True
            self.checks_left -= 1
        if self.lost or self._holders.get(self.account_id) is not self:
            raise LockLost(f"lock of {self.account_id} lost")

    def progress(self) -> None:
        self.progress_at.append(self._store.clock())

    def release(self, arrival: Arrival | None = None, rider: EndRider | None = None) -> bool:
        self.marked = None if arrival is None else arrival.mark in self._marks
        self.released_with.append(rider)
        if self._holders.get(self.account_id) is self:
            del self._holders[self.account_id]
            return True
        return False


def ok(payment_id: str = "pay-1") -> GatewayResult:
    return GatewayResult(Outcome.SUCCEEDED, 201, payment_id=payment_id)


def answer(outcome: Outcome, status: int | None, **kw: Any) -> GatewayResult:
    return GatewayResult(outcome, status, **kw)


class FakeGateway:
    """Answers from a script per key (else success); pays at most what it was told to."""

    def __init__(self) -> None:
        self.script: dict[str, deque[GatewayResult]] = defaultdict(deque)
        self.lookup_script: dict[str, deque[GatewayResult]] = defaultdict(deque)
        self.calls: list[tuple[str, str]] = []
        self.paid: dict[str, int] = defaultdict(int)
        self.on_call: Any = None  # a hook run before each answer (e.g. to lose the lock)
        self.done: list[str] = []  # accounts whose holder said it was done with them
        self.held: list[bool] = []  # each call's `held`: the caller said it holds the lock

    def create_payment(
        self,
        account_id: str,
        transaction: PaymentRequest,
        idempotency_key: str,
        guard: Guard | None = None,
        *,
        held: bool = False,
    ) -> GatewayResult:
        if guard is not None:
            guard()  # as the real client: the last check before the request leaves
        self.calls.append(("create", idempotency_key))
        self.held.append(held)
        if self.on_call is not None:
            self.on_call("create", idempotency_key)
        queued = self.script[idempotency_key]
        result = queued.popleft() if queued else ok(f"pay-{idempotency_key}")
        if result.outcome is Outcome.SUCCEEDED or (
            result.outcome is Outcome.UNKNOWN and result.reason == "applied"
        ):
            self.paid[idempotency_key] += 1
        return result

    def lookup_payment(
        self,
        account_id: str,
        idempotency_key: str,
        guard: Guard | None = None,
        *,
        held: bool = False,
    ) -> GatewayResult:
        if guard is not None:
            guard()
        self.calls.append(("lookup", idempotency_key))
        self.held.append(held)
        queued = self.lookup_script[idempotency_key]
        if queued:
            return queued.popleft()
        if self.paid[idempotency_key]:
            return ok(f"pay-{idempotency_key}")
        return answer(Outcome.NOT_FOUND, 404, reason="not_found")

    def account_start(self, account_id: str) -> Rider | None:
        return None  # nothing shared to read: the fake keeps no token or pacing

    def prefetch_token(self, account_id: str) -> None:
        pass  # no token to ask for: the fake keeps none

    def account_end(self, account_id: str) -> EndRider | None:
        self.done.append(account_id)
        return FakeEnd(("pace", "token-lock"), (account_id,))

    def sends(self, key: str) -> int:
        return sum(1 for kind, k in self.calls if kind == "create" and k == key)


@dataclass(frozen=True)
class FakeEnd:
    """What a FakeGateway's account_end hands the lock's release (the fake keeps no state
    to give back; tests check that the rider reaches the release)."""

    keys: tuple[str, str]
    args: tuple[bytes | str | float, ...]


@dataclass
class FakeQueue:
    """The "work waiting" marks (by account, the batch that left it) and what was put on the
    queue; a FakeLock given ``marks`` writes them as the real lock's script does."""

    marks: dict[str, str] = field(default_factory=dict)
    handed_off: list[tuple[str, str]] = field(default_factory=list)
    scheduled: list[tuple[str, str, float]] = field(default_factory=list)

    def arrival(self, account_id: str, batch_id: str) -> Arrival:
        return Arrival(account_id, batch_id, 120_000)

    def announce(self, account_id: str, batch_id: str) -> None:
        self.marks[account_id] = batch_id

    def announced(self, account_id: str) -> bool:
        return account_id in self.marks

    def hand_off(self, account_id: str, batch_id: str) -> None:
        self.handed_off.append((account_id, batch_id))

    def schedule(self, account_id: str, batch_id: str, wait: float) -> float:
        self.scheduled.append((account_id, batch_id, wait))
        return wait
