"""A process's lease of an account's pacing slots (:class:`Lease`), and the quota's second.

:mod:`payment_worker.gateway.pacing` leases an account's request slots from Redis in
blocks and spends them here, on the process's clock. A lease also keeps the process's last
floor(rate) requests of the account (``Lease.recent``), carried from lease to lease: the
protocol's "at most `rate` requests per second" read to the letter, no second (counted as
:data:`WINDOW`) holds more than floor(rate) of them, and :func:`next_free` tells where a
next holder, in any process, may start so that the two together keep it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# the protocol's "at most `rate` requests per second", read to the letter: no span of one
# second holds more than floor(rate) of a holder's requests. A second is counted 2 % long:
# a gateway counts a request when it has arrived and been read, a few milliseconds after it
# left here, more or less from one request to the next. Measured against the simulator's
# sliding-second limit (--rate-limit window) in scenario 3 on a loaded 2-core host: 36 to
# 45 429s a run with 1.001 s, 4 with 1.005 s, none with 1.02 s (docs/benchmarks.md)
WINDOW = 1.02


def per_second(interval: float) -> int:
    """The most requests one second may hold at one request per ``interval`` s: floor(rate),
    at least 1."""
    return max(1, int(1.0 / interval + 1e-6))


@dataclass(slots=True)
class Lease:
    """Slots of one account leased by this process, on the local clock."""

    interval: float  # seconds between two slots (1 / rate)
    next_at: float  # the earliest moment the next slot may be used
    end: float  # no slot is used at or after this moment (the lease's window)
    left: int  # slots not yet used
    used: int = 0
    tat: bytes | None = None  # the account's first free slot after this lease, as stored
    kept: bool = False  # a lock holder went on past the lease, on its own spacing
    last_use: float = float("-inf")  # when the last slot was used (the request let go)
    # this process's last uses of the account, one second's worth (per_second), oldest
    # first: a use waits until the oldest is a WINDOW back. Carried from lease to lease
    recent: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        # uses carried from a lease of another rate: that rate's floor of them, the latest
        most = per_second(self.interval)
        if self.recent.maxlen != most:
            self.recent = deque(self.recent, maxlen=most)

    def due(self, at: float) -> float:
        """``at``, or later when a use then would put more than one second's worth of uses
        in one second."""
        recent = self.recent
        if len(recent) == recent.maxlen:
            return max(at, recent[0] + WINDOW)
        return at

    def use(self, now: float) -> None:
        """A slot used now (the request let go)."""
        self.used += 1
        self.last_use = now
        self.recent.append(now)

    def void(self) -> Lease:
        """What is kept of this lease once it is dropped (a 429's cooldown, a lease refused
        for lying too far ahead, Redis out of reach): its uses, which still space the next
        request, and its ``tat`` for the give-back; no slot and no window, so the next lease
        is asked for as by a process that comes fresh."""
        return Lease(
            self.interval,
            self.next_at,
            float("-inf"),
            0,
            tat=self.tat,
            last_use=self.last_use,
            recent=self.recent,
        )


def spent_by(lease: Lease) -> float:
    """When a lease stops mattering: its window over, its next slot due, and its uses no
    longer spacing the next (:func:`next_free`: a next lease from Redis then keeps the
    quota by itself)."""
    return max(lease.end, lease.next_at, next_free(lease))


def spent(lease: Lease, now: float) -> bool:
    """``spent_by(lease) <= now``, without reading the uses when the last is long past (a
    sweep reads every lease the process keeps)."""
    if max(lease.end, lease.next_at) > now:
        return False
    # (next_free is never later than this)
    if lease.last_use + max(lease.interval, WINDOW) <= now:
        return True
    return next_free(lease) <= now


def next_free(lease: Lease) -> float:
    """The earliest moment another holder, starting afresh and sending one request per
    interval from then, keeps the quota with this lease's uses before it: an interval after
    the last use, and late enough that no second holds more than floor(rate) of the two
    holders' requests together. The successor's j-th request leaves at least j intervals
    after it starts, and the one ``per_second`` before it in the joint order is this
    holder's, if any."""
    free = lease.last_use + lease.interval
    recent = lease.recent
    assert recent.maxlen is not None
    # the successor's j-th request follows recent[i] by per_second - (k - i) requests
    back = recent.maxlen - len(recent)
    for i, at in enumerate(recent):
        free = max(free, at + WINDOW - (back + i) * lease.interval)
    return free
