"""Per-account request pacing shared by every worker process: slots leased from Redis in blocks.

Each account has one timeline of request slots, ``1/rate`` apart, kept in Redis on the
Redis server's clock (so processes on hosts with skewed clocks agree): ``tat`` is the first
free slot. One Lua script leases a block of consecutive slots, up to ``rate x
GATEWAY_PACING_LEASE_SECONDS`` of them (one when that is below 2), and the process spends
them locally without another round trip:

* Leased slots are used at lease time: no other process gets them, so the account never
  gets more than one request per interval from all processes together, as with one script
  per request. The slots of one lease are spent in order, at least one interval apart, none
  before its time; a slot not used before the lease's window ends (its last slot's time)
  is void, so an unused lease only expires, it never piles up into a burst.
* A block is one lease window (0.5 s by default) of the account's time, whatever the
  holder's pace: one slower than the rate still spends several slots per window (a
  holder at 30 ms per request: 3 or 4 per script). A process coming fresh may reserve a
  block up to one block ahead, one that just spent a block only the next slot, so a
  waiting process gets the next block first (normally there is none: the account lock
  gives the account to one holder at a time).
* A holder done with the account (its drain ends, the account lock about to be released)
  gives the unused rest of its lease back (:meth:`Pacer.returned`, sent in the lock's
  release), unless another lease
  followed: the next holder, in any process, starts an interval later (or as much later
  as the holder's last second of requests asks, :func:`next_free`) instead of after the
  window. A window can therefore span many requests at real gateway latency (one
  script per block, not per request) without delaying the next holder; only a holder that
  dies keeps its window until it ends.
* **A lock holder past its lease keeps its own spacing** (``held=True``: the caller holds
  the account's lock, so nobody else sends for the account until it is done). Once its
  lease is spent or its window over, its next request needs no script: it goes one
  interval after its previous slot on the local clock, and never less than half an
  interval after its last request, so a thread that wakes a little late (a core or the GIL
  taken) makes the delay up instead of adding it to every interval, while no span of L
  seconds holds more than rate x L + 1.5 of its requests (rate x L + 1 spaced from each
  use: the same whole number for a whole second at a whole rate). Redis learns the holder's
  spacing when it is done (the give-back sets the first free slot where a next holder
  keeps the quota with this one's last second, :func:`next_free`, when that is still
  ahead). A holder at real gateway
  latency (one request per second, a quota of 20/s) thus runs one script per drain instead
  of one per request. A holder that dies cannot hand its spacing over, and needs not: its
  account is taken over only after its liveness (3 s by default) or its lock lapses, while
  this applies only when a lease spans at least two slots (``GATEWAY_PACING_LEASE_SECONDS``
  x rate >= 2, so an interval is at most half a lease window, at most 0.5 s). Callers that
  do not hold the lock (``held=False``) lease as above, and several processes sending for
  one account together still keep the quota.
* **Never more than floor(rate) in any second** (the protocol's "at most `rate` requests per
  second" read to the letter): a process keeps its last floor(rate) uses of an account
  (``Lease.recent``, carried from lease to lease), and a use waits until the oldest is
  1.02 s back (``WINDOW``), whatever else allows it; a lease is swept only once its uses
  no longer count, and one dropped sooner (refused, closed by a 429, Redis out of reach)
  leaves its uses behind (``Lease.void``); so a delay is made up only as far as the last
  second leaves room. A holder done with the account gives back the slot
  from which a next holder, sending one request per interval, keeps the two holders'
  requests together at floor(rate) in any second (:func:`next_free`). Callers without the
  lock sharing an account keep the looser rate x L + 2.
* A 429's ``Retry-After`` is recorded in the same key as a cooldown: no slot is leased
  before it ends. The process that records it drops its own lease at once (and keeps the
  account closed itself, even if the write fails); a lease held by another process runs
  out within its window, and a lock holder past its lease does not read the cooldown
  again before its drain ends.

Key: ``{prefix}:pace:{account}`` (a hash: ``tat``, ``until``; the ``{account}`` hash tag keeps
all of an account's keys in one Redis Cluster slot). Scripts: ``lua/pace_acquire.lua``,
``lua/pace_cooldown.lua``, and the give-back's ``lua/lib/pace_return.lua`` in the lock's
release (``lua/account_end.lua``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from payment_worker import lua
from payment_worker.gateway.pacing_lease import Lease, next_free, spent, spent_by
from payment_worker.ops.metrics import GATEWAY_PACING_WAIT_SECONDS
from payment_worker.redis_keys import RedisKeys

# lease slots (or the ms to wait) and record a 429's cooldown, on the server's clock
_ACQUIRE = lua.load("pace_acquire")
_COOLDOWN = lua.load("pace_cooldown")

# leases (and closed accounts) kept in a process before the first sweep of those that no
# longer matter (one per account in flight); later sweeps come at twice what the last kept
_SWEEP_AT = 1024


@dataclass(frozen=True, slots=True)
class PaceResult:
    """The outcome of waiting for a slot: taken, or given up after ``waited`` seconds."""

    acquired: bool
    waited: float
    retry_after: float = 0.0  # when not acquired: how long the account is still closed


class Pacer:
    """A per-account slot timeline shared through Redis, leased in blocks; thread-safe.

    ``lease_seconds`` 0 leases one slot per script call (one round trip per request).
    """

    def __init__(
        self,
        redis_client: redis.Redis,
        prefix: str = "pw",
        *,
        lease_seconds: float = 0.0,
        max_poll: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = RedisKeys(prefix)
        self._lease_seconds = lease_seconds
        self._max_poll = max_poll
        self._clock = clock
        self._acquire = redis_client.register_script(_ACQUIRE)
        self._cooldown = redis_client.register_script(_COOLDOWN)
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        # accounts whose lease script is in flight: the process's other threads wait for its
        # block instead of leasing a second one (which would void the first)
        self._leasing: set[str] = set()
        self._leased = threading.Condition(self._lock)
        # accounts Redis said are closed (cooldown, other processes' slots): (when to ask
        # again, its first slot then within reach; when that slot opens). The process's
        # other threads wait without asking again
        self._closed: dict[str, tuple[float, float]] = {}
        # leases and closed accounts kept before the next sweep: twice what the last sweep
        # kept, so that a process with more accounts in flight does not sweep at every lease
        self._sweep_at = _SWEEP_AT
        self.scripts = 0  # lease scripts run (tests and benchmarks)

    def key(self, account_id: str) -> str:
        """The Redis key of an account's slot timeline."""
        return self._keys.pace(account_id)

    def block(self, rate: float) -> int:
        """How many slots one script call leases at ``rate`` requests/s."""
        return max(1, int(rate * self._lease_seconds + 1e-9))

    def try_acquire(
        self, account_id: str, rate: float, ahead: float | None = None, *, held: bool = False
    ) -> float:
        """Take a slot now if one is free: 0.0, else the seconds to wait before asking again.

        A slot of this process's lease costs no round trip. Otherwise one script leases a
        block, provided its first slot is at most one lease window (or ``ahead`` seconds,
        when smaller) away; a block starting later leases nothing and the wait is returned.
        ``held``: the caller holds the account's lock; past its lease it keeps its own
        spacing without a script (see the module).
        """
        return self._try(account_id, rate, ahead, held)[0]

    def _try(
        self, account_id: str, rate: float, ahead: float | None, held: bool
    ) -> tuple[float, float]:
        """:meth:`try_acquire`'s wait, and the seconds until the account's next slot opens
        (the wait may be shorter: then the slot is within a lease's reach)."""
        interval = 1.0 / rate
        now = self._clock()
        with self._lock:
            while account_id in self._leasing:
                self._leased.wait(1.0)
                now = self._clock()
            closed = self._closed.get(account_id)
            if closed is not None:
                if closed[0] > now:
                    return closed[0] - now, closed[1] - now
                del self._closed[account_id]
            lease = self._leases.get(account_id)
            if lease is not None:
                wait = self._take(lease, interval, now)
                if wait is None and held and self.block(rate) >= 2:
                    wait = self._keep(lease, interval, now)
                if wait is not None:
                    return wait, wait
                del self._leases[account_id]
            self._leasing.add(account_id)
        try:
            return self._lease(account_id, rate, interval, ahead, lease, now)
        finally:
            with self._lock:
                self._leasing.discard(account_id)
                self._leased.notify_all()

    def _lease(
        self,
        account_id: str,
        rate: float,
        interval: float,
        ahead: float | None,
        last: Lease | None,
        now: float,
    ) -> tuple[float, float]:
        """One script call: lease a block of the account's slots and take the first if due."""
        # a whole block each time: a holder slower than the rate (busy CPU, gateway latency)
        # still spends several slots of a block's window, and nobody else wants the account
        # while its lock is held. Fairness: a process that just spent a block may lease the
        # next one only when it is (about) due, while one that comes fresh may reserve up to
        # a whole block ahead, so a waiting process gets the next block before the last
        # holder asks again.
        n, reach_ms = self._reach(rate, interval, last, now)
        ahead_ms = reach_ms if ahead is None else max(0.0, min(reach_ms, ahead * 1000))
        sent = self._clock()
        try:
            answer = self._acquire(keys=[self.key(account_id)], args=[rate, n, ahead_ms])
        except Exception:
            self._keep_uses(account_id, last)
            raise
        return self._install(account_id, interval, last, answer, sent)

    def _keep_uses(self, account_id: str, last: Lease | None) -> None:
        """No lease came in place of ``last``: its uses are kept (:meth:`Lease.void`)."""
        if last is not None and last.recent:
            with self._lock:
                self._leases.setdefault(account_id, last.void())

    def _reach(
        self, rate: float, interval: float, last: Lease | None, now: float
    ) -> tuple[int, float]:
        """The slots a lease asks for, and how far ahead (ms) its first may lie."""
        n = self.block(rate)
        continuing = last is not None and last.end > now - 1.0
        return n, (1 if continuing else n) * interval * 1000

    def _install(
        self,
        account_id: str,
        interval: float,
        last: Lease | None,
        answer: Sequence[Any],
        sent: float,
        take: bool = True,
    ) -> tuple[float, float]:
        """A lease script's answer (sent at ``sent``) kept: 0.0 (a slot taken), or the wait;
        and the seconds until the slot opens. ``take=False``: only kept (the slot is taken
        by the request that comes for it)."""
        got = self._clock()
        self.scripts += 1
        granted, delay = answer[0], answer[1]
        delay_s = float(delay) / 1000
        if int(granted) == 0:
            opens_s = float(answer[2]) / 1000 if len(answer) > 2 else delay_s
            with self._lock:
                if len(self._leases) + len(self._closed) >= self._sweep_at:
                    self._sweep(got)
                self._closed[account_id] = (got + delay_s, got + opens_s)
            self._keep_uses(account_id, last)
            return delay_s, opens_s
        # the first slot is never used before its time (counted from the answer), the last
        # never after the window as the server knows it (counted from the request)
        start = got + delay_s
        granted = int(granted)
        # its last second of uses still counts (a new rate's floor of them: Lease)
        lease = Lease(
            interval,
            start,
            sent + delay_s + granted * interval,
            granted,
            last_use=float("-inf") if last is None else last.last_use,
            recent=deque() if last is None else last.recent,
        )
        if last is not None:
            # a slot of the last lease used late (a slow request) must not bunch up with the
            # first of this one: this process's own requests stay an interval apart
            lease.next_at = max(start, last.next_at)
        lease.tat = _as_bytes(answer[2]) if len(answer) > 2 else None
        with self._lock:
            if len(self._leases) + len(self._closed) >= self._sweep_at:
                self._sweep(got)
            self._leases[account_id] = lease
            wait = self._take(lease, interval, self._clock()) if take else None
        wait = wait if wait is not None else delay_s
        return wait, wait

    def start_args(self, account_id: str, rate: float) -> tuple[float, int, float] | None:
        """A lease's arguments (rate, slots, reach in ms) for a lock holder's start script
        (``lua/account_start.lua``), or None when this process still has a lease of the
        account, or knows it closed, or is leasing it now: the first request decides then."""
        now = self._clock()
        with self._lock:
            if account_id in self._leasing:
                return None
            closed = self._closed.get(account_id)
            if closed is not None and closed[0] > now:
                return None
            last = self._leases.get(account_id)
            if last is not None and spent_by(last) > now:
                return None
        n, reach_ms = self._reach(rate, 1.0 / rate, last, now)
        return rate, n, reach_ms

    def started(self, account_id: str, rate: float, answer: Sequence[Any], sent: float) -> None:
        """The start script's lease (``pace_acquire.lua``'s answer, the script sent at
        ``sent`` on this pacer's clock), kept as a lease of :meth:`try_acquire` is: the
        holder's first request takes its slot without a round trip."""
        with self._lock:
            last = self._leases.pop(account_id, None)
        try:
            self._install(account_id, 1.0 / rate, last, answer, sent, take=False)
        except Exception:
            self._keep_uses(account_id, last)  # an answer it could not read
            raise

    def now(self) -> float:
        """This pacer's clock (a start script's send time is read on it)."""
        return self._clock()

    @staticmethod
    def _take(lease: Lease, interval: float, now: float) -> float | None:
        """With the lock held: 0.0 (a slot taken), the wait for the next slot, or None when
        the lease is spent, void or of another rate."""
        if lease.left <= 0 or lease.interval != interval:
            return None
        at = lease.due(max(now, lease.next_at))
        # the first slot is always usable: it is the one a single-slot lease would give
        if lease.used > 0 and at >= lease.end:
            return None
        if at > now:
            return at - now
        lease.left -= 1
        lease.use(now)
        lease.next_at = now + interval  # spaced from this use, never bunched after a delay
        return 0.0

    @staticmethod
    def _keep(lease: Lease, interval: float, now: float) -> float | None:
        """With ``_lock`` held, for a caller that holds the account's lock and is past a lease
        it used: 0.0 (a slot taken, one interval after the previous slot, at least half an
        interval after the last use, and no more than floor(rate) uses in a second), the
        wait for that slot, or None (no such lease: a script decides)."""
        if lease.used == 0 or lease.interval != interval:
            return None
        at = lease.due(lease.next_at)
        if at > now:
            return at - now
        lease.use(now)
        lease.kept = True
        # one interval after the previous slot, so a use delayed by less than half an
        # interval (a core or the GIL taken) is made up, not added to the spacing; never
        # less than half an interval after this use: uses i < j stay (j - i - 1/2) intervals
        # apart, at most rate x L + 1.5 in any span of L seconds (rate x L + 1 before). A
        # delay is made up only as far as the last second's uses leave room (``due``)
        lease.next_at = max(lease.next_at + interval, now + interval / 2)
        return 0.0

    def _sweep(self, now: float) -> None:
        # a lease whose uses still space the next request (spent: an interval after the last
        # use, and its last second's uses a second back) is kept
        expired = [a for a, lease in self._leases.items() if spent(lease, now)]
        for account_id in expired:
            del self._leases[account_id]
        for account_id in [a for a, (ask, _) in self._closed.items() if ask <= now]:
            del self._closed[account_id]
        self._sweep_at = max(_SWEEP_AT, 2 * (len(self._leases) + len(self._closed)))

    def acquire(
        self, account_id: str, rate: float, max_wait: float, *, held: bool = False
    ) -> PaceResult:
        """Wait for a slot of ``account_id`` at ``rate`` requests/s, at most ``max_wait`` s.

        Gives up at once, without sleeping, when the account's next slot opens (a 429
        cooldown or other processes' slots) more than ``max_wait`` from the start; the caller
        reschedules instead of blocking, ``retry_after`` the time until it opens. ``held``:
        the caller holds the account's lock (see the module).
        """
        start = time.monotonic()
        waited = 0.0
        while True:
            wait, opens = self._try(account_id, rate, max_wait - waited, held)
            waited = time.monotonic() - start
            if wait <= 0:
                GATEWAY_PACING_WAIT_SECONDS.observe(waited)
                return PaceResult(True, waited)
            # (the slot opens, not only comes within reach: a wait that only reaches it
            # slept nearly max_wait and then gave up anyway)
            if waited + max(wait, opens) > max_wait:
                GATEWAY_PACING_WAIT_SECONDS.observe(waited)
                return PaceResult(False, waited, retry_after=max(wait, opens))
            # ask again: a leased slot comes due, another process's lease ends, a 429 closes it
            time.sleep(min(wait, self._max_poll))
            waited = time.monotonic() - start

    def returned(self, account_id: str) -> tuple[bytes, float] | None:
        """The holder is done with the account: this process's lease of it is dropped, and
        what to give back is returned when there is something to give, else None: the
        ``tat`` its lease left and the ms from now to the account's next free slot
        (``lua/account_end.lua``'s ARGV[3] and ARGV[4]). Something to give: a lease with
        slots left whose window has not ended (the next slot an interval from now), or a
        next free slot still ahead (:func:`next_free`: the last request left less than an
        interval ago, or the last second's requests leave no room yet; the stored timeline
        does not know: a slot is spent from its actual use, so the last may go just before
        the window ends, and a holder past its lease goes on on its own spacing). The lock's
        release sends it (``lua/account_end.lua``: if nobody leased since, the first free
        slot becomes that far from then)."""
        with self._lock:
            lease = self._leases.pop(account_id, None)
        if lease is None or lease.tat is None:
            return None
        now = self._clock()
        free = next_free(lease)
        if free > now + lease.interval:
            return lease.tat, (free - now) * 1000
        if free > now:
            return lease.tat, lease.interval * 1000  # an interval after this release
        if lease.kept or lease.left <= 0 or lease.end <= now:
            return None  # spent, or the window is over: the timeline has passed it already
        return lease.tat, lease.interval * 1000

    def cooldown(self, account_id: str, seconds: float) -> float:
        """Close the account for ``seconds`` in every process (a 429's Retry-After); this
        process's own leased slots of the account are dropped at once, and it keeps the
        account closed itself even when the script fails (Redis out of reach: the caller
        logs it, and this process's next request must not meet another 429)."""
        now = self._clock()
        with self._lock:
            lease = self._leases.pop(account_id, None)
            if lease is not None and lease.recent:
                self._leases[account_id] = lease.void()  # its uses still count
            self._closed[account_id] = (now + seconds, now + seconds)
        ms = max(1, int(seconds * 1000))
        # (a longer cooldown already recorded stands: the answer is its time left)
        left = int(self._cooldown(keys=[self.key(account_id)], args=[ms])) / 1000.0
        with self._lock:
            self._closed[account_id] = (now + left, now + left)
        return left


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
