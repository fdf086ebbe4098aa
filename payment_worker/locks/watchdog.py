"""Lock renewal: one thread per process renews every held lock, batched into one round trip.

* :class:`Renewer` keeps a registry of held locks (:class:`Lease`) and one daemon thread.
  Each tick it renews every lease that is due (or due within a tenth of an interval, so
  leases acquired close together share a batch) with one pipeline of owner-checked
  ``EVALSHA lock_renew`` calls: one round trip per tick, however many locks are held.
* The pipeline is not a transaction and the script takes one key, so every call stays in
  its own account's hash slot; a Redis Cluster client splits such a pipeline by node.
  (One script over many keys would cross slots, and a MULTI would pin one slot.)
* Each lease keeps its own rules, unchanged from one thread per lock: the holder's stall
  check before the renewal, the answer (renewed, gone, stolen) read per lock, a failed round
  trip retried sooner until the lock's local deadline, and a release that removes the lease
  at once (an answer in flight for a released lease is discarded).
* :func:`renewal_client` builds the client it renews through; :class:`StallRule` tells when
  a holder stopped making progress.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from payment_worker import lua
from payment_worker.ops.logging import get_logger

log = get_logger("watchdog")

# 1 renewed, 0 key gone, -1 owned by another token (payment_worker/lua/lock_renew.lua)
RENEW_LUA = lua.load("lock_renew")

# per-pool state of the pool's notification machinery, not connection settings
_POOL_OWNED_KWARGS = ("maint_notifications", "orig_")

# a lease due within this fraction of its interval is renewed with the batch that runs now:
# at most ~10 round trips per interval whatever the number of locks, renewals <= 10 % early
COALESCE_FRACTION = 0.1

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def clock() -> float:
    """Seconds on a clock that keeps counting while the process (or the host) is suspended.

    CLOCK_MONOTONIC stops during a system suspend on Linux while the Redis TTL keeps
    running; CLOCK_BOOTTIME does not stop, so the local deadline stays conservative.
    """
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()


def renewal_client(client: redis.Redis, ttl_ms: int) -> redis.Redis:
    """A client for renewals: the caller's connection settings, no retries, timeout <= TTL/3.

    The renewer sends through its own small pool: the default redis-py retries can stretch
    one failed call over seconds, and a client without a socket timeout would block forever
    on a hung server. Build one per process (the Runtime does) and share it between locks.
    """
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    limit = ttl_ms / 3000
    timeout = round(min(limit, float(kwargs.get("socket_timeout") or limit)), 3)
    for name in list(kwargs):
        if name.startswith(_POOL_OWNED_KWARGS):
            del kwargs[name]
    kwargs.update(
        retry=Retry(NoBackoff(), 0), socket_timeout=timeout, socket_connect_timeout=timeout
    )
    # unbounded like redis-py's default: a full pool would fail renewals
    return redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    )


class StallRule:
    """When the holder last reported progress, and whether it has stalled.

    The holder calls :meth:`touch` whenever it gets something done (a claim, an item, a
    request about to leave, a recorded chunk); the renewer asks :meth:`stalled_for` before
    each renewal. A holder silent for ``max_stall`` seconds is blocked somewhere (a statement
    waiting on a lock, a hung connection): renewing its lock would keep the account from
    everyone for as long as it stays blocked. ``max_stall`` None: the rule is off.
    """

    def __init__(self, max_stall: float | None, clock: Callable[[], float]) -> None:
        if max_stall is not None and max_stall <= 0:
            raise ValueError("max_stall must be > 0 (or None: off)")
        self.max_stall = max_stall
        self._clock = clock
        self._last = clock()

    def touch(self) -> None:
        """The holder made progress now (one float store: safe from any thread)."""
        self._last = self._clock()

    def stalled_for(self) -> float | None:
        """Seconds since the last progress when that is ``max_stall`` or more, else None."""
        if self.max_stall is None:
            return None
        silent = self._clock() - self._last
        return silent if silent >= self.max_stall else None


@dataclass(eq=False)
class Lease:
    """One held lock in the renewer's registry; the callbacks belong to its holder.

    ``check()`` runs before each renewal: False drops the lease without renewing (released,
    lost, or stalled: the holder marks itself). ``renewed(answer, sent)`` gets the script's
    answer and the clock reading taken before the batch was sent: False drops the lease.
    ``failed(error)`` after a failed round trip: the delay to the next try, or None to drop.
    All three run on the renewer's thread and must not block.
    """

    key: str
    token: str
    ttl_ms: int
    check: Callable[[], bool]
    renewed: Callable[[int, float], bool]
    failed: Callable[[Exception], float | None]
    interval: float = 0.0  # TTL/3 unless set
    due: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if self.interval <= 0:
            self.interval = self.ttl_ms / 3000


RenewMany = Callable[[list[Lease]], list[object]]
"""Send one batch of renewals; per lease the script's answer or the exception it raised."""


class DueLoop:
    """One daemon thread that runs :meth:`_tick` whenever an entry is due, and ends once
    nothing was registered for ``_linger`` seconds. Subclasses keep the entries, under
    ``_cond``, and say when the next one is due (:meth:`_next_due`)."""

    _cond: threading.Condition
    _closed: bool
    _linger: float
    _clock: Callable[[], float]
    _thread: threading.Thread | None

    def _next_due(self) -> float | None:
        """With ``_cond`` held: when the earliest entry is due; None when there is none."""
        raise NotImplementedError

    def _tick(self) -> None:
        """Handle what is due (on the thread, without ``_cond``)."""
        raise NotImplementedError

    def _start(self, name: str) -> None:
        """With ``_cond`` held: start the thread if none runs."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wait_for_due():
                    self._thread = None
                    return
            self._tick()

    def _wait_for_due(self) -> bool:
        """With ``_cond`` held: wait until an entry is due; False when it is time to end."""
        while True:
            if self._closed:
                return False
            due = self._next_due()
            if due is None:
                self._cond.wait(self._linger)
                if self._next_due() is None:
                    return False
                continue
            wait = due - self._clock()
            if wait <= 0:
                return True
            self._cond.wait(wait)


class Renewer(DueLoop):
    """The registry of held locks and the one thread that renews them (thread-safe).

    The thread starts with the first lease and ends once no lease was held for
    ``linger`` seconds, so an idle process keeps no thread. :meth:`remove` takes effect at
    once: the lease is never sent again, and an answer in flight for it is discarded.
    ``threaded=False`` starts no thread: the caller drives :meth:`tick` (tests).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        clock: Callable[[], float] = clock,
        linger: float = 5.0,
        name: str = "lock-renewer",
        threaded: bool = True,
    ) -> None:
        self._client = client
        self._clock = clock
        self._linger = linger
        self._name = name
        self._threaded = threaded
        self._sha: str | None = None
        self._reset()
        # counters for tests and benchmarks: batches sent, renewals sent
        self.batches = 0
        self.renewals = 0

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._leases: dict[int, Lease] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- registry ---------------------------------------------------------------------

    def add(self, lease: Lease) -> None:
        """Start renewing ``lease``: its first renewal comes one interval from now."""
        if self._pid != os.getpid():
            self._reset()  # forked: the parent's thread and leases are not ours
        lease.due = self._clock() + lease.interval
        with self._cond:
            # a lock taken after close() (a caller still holding an old runtime's lock
            # object) is renewed all the same: refusing it here would leave it held in Redis
            self._closed = False
            self._leases[id(lease)] = lease
            if self._threaded:
                self._start(self._name)
            self._cond.notify()

    def remove(self, lease: Lease) -> None:
        """Stop renewing ``lease`` now (a release, a loss); returns at once, never waits."""
        with self._cond:
            if self._leases.pop(id(lease), None) is not None and not self._leases:
                self._cond.notify()  # let an idle thread start its linger

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still being renewed."""
        return id(lease) in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def thread(self) -> threading.Thread | None:
        """The renewal thread while it runs (tests and diagnostics)."""
        return self._thread

    def close(self) -> None:
        """Stop renewing everything held now and end the thread (the end of the process's
        runtime); a lease added later starts it again."""
        with self._cond:
            self._closed = True
            self._leases.clear()
            self._cond.notify()

    # --- the thread -------------------------------------------------------------------

    def _next_due(self) -> float | None:
        if not self._leases:
            return None
        return min(lease.due for lease in self._leases.values())

    def _tick(self) -> None:
        try:
            self.tick()
        except Exception:
            # a bug must not end renewal silently; each holder's local deadline still
            # protects it if renewals keep failing
            log.exception("lock_renewer_tick_failed")
            time.sleep(0.05)

    def tick(self) -> float | None:
        """Renew every lease due now (one round trip); the seconds until the next one is due,
        or None when none is held. The thread calls this; tests may drive it by hand."""
        now = self._clock()
        with self._cond:
            due = [
                lease
                for lease in self._leases.values()
                if lease.due <= now + lease.interval * COALESCE_FRACTION
            ]
        batch: list[Lease] = []
        for lease in due:
            if self._still_held(lease) and lease.check():
                batch.append(lease)
            else:
                self.remove(lease)  # released, lost or stalled: never renewed again
        if batch:
            sent = self._clock()
            try:
                answers = self.renew_many(batch)
            except RedisError as exc:
                answers = [exc] * len(batch)
                log.warning("lock_renew_failed", locks=len(batch), error=str(exc))
            self.batches += 1
            self.renewals += len(batch)
            for lease, answer in zip(batch, answers, strict=True):
                self._settle(lease, answer, sent)
        with self._cond:
            if not self._leases:
                return None
            return max(0.0, min(lease.due for lease in self._leases.values()) - self._clock())

    def _still_held(self, lease: Lease) -> bool:
        return id(lease) in self._leases

    def _settle(self, lease: Lease, answer: object, sent: float) -> None:
        if not self._still_held(lease):
            return  # released while the renewal was in flight: its answer means nothing now
        if not isinstance(answer, int):
            if not isinstance(answer, Exception):
                answer = RedisError(f"unexpected renewal answer {answer!r}")
            delay = lease.failed(answer)
            if delay is None:
                self.remove(lease)
            else:
                lease.due = self._clock() + delay
            return
        if lease.renewed(answer, sent):
            lease.due = sent + lease.interval
        else:
            self.remove(lease)

    def renew_many(self, batch: list[Lease]) -> list[object]:
        """One round trip: the owner-checked renewal of every lease in ``batch``, pipelined.

        A server that lost the script (restarted, ``SCRIPT FLUSH``) gets it loaded again and
        the batch resent once. Raises :class:`RedisError` when the round trip fails.
        """
        if self._sha is None:
            self._sha = str(self._client.script_load(RENEW_LUA))
        answers = self._pipeline(batch, self._sha)
        if any(isinstance(a, NoScriptError) for a in answers):
            self._sha = str(self._client.script_load(RENEW_LUA))
            answers = self._pipeline(batch, self._sha)
        return answers

    def _pipeline(self, batch: list[Lease], sha: str) -> list[object]:
        pipe = self._client.pipeline(transaction=False)
        for lease in batch:
            pipe.evalsha(sha, 1, lease.key, lease.token, lease.ttl_ms)
        return list(pipe.execute(raise_on_error=False))
