"""Lock renewal: a background thread that stops the moment it is told to (an Event, never a
sleep), the owner-checked renewal script and the client that runs it, and the stall rule that
tells it when to stop renewing for a holder that no longer makes progress."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from payment_worker import lua
from payment_worker.ops.logging import get_logger

log = get_logger("watchdog")

# 1 renewed, 0 key gone, -1 owned by another token (payment_worker/lua/lock_renew.lua)
RENEW_LUA = lua.load("lock_renew")

# per-pool state of the pool's notification machinery, not connection settings
_POOL_OWNED_KWARGS = ("maint_notifications", "orig_")


def renewal_client(client: redis.Redis, ttl_ms: int) -> redis.Redis:
    """A client for renewals: the caller's connection settings, no retries, timeout <= TTL/3.

    The watchdog renews through its own small pool: the default redis-py retries can stretch
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
    request about to leave, a recorded chunk); the watchdog asks :meth:`stalled_for` before
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


Tick = Callable[[], float | None]
"""One renewal step: returns the delay (seconds) to the next step, or None to stop."""


class Watchdog:
    """A daemon thread that calls ``tick`` every ``interval`` seconds until stopped.

    ``tick`` decides the next delay itself (shorter after a failed renewal) or stops the
    thread by returning None. :meth:`stop` wakes the thread at once: a release never
    waits for the next tick.
    """

    def __init__(self, tick: Tick, interval: float, *, name: str) -> None:
        self._tick = tick
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread; the first tick comes after one interval."""
        self._thread.start()

    def stop(self) -> None:
        """Tell the thread to stop; returns at once (the thread exits on its own)."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called (a tick in flight must discard its result)."""
        return self._stop.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (tests and shutdown; release never calls this)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the thread is still running."""
        return self._thread.is_alive()

    def _run(self) -> None:
        delay: float | None = self._interval
        while delay is not None and not self._stop.wait(delay):
            try:
                delay = self._tick()
            except Exception:
                # a bug in a tick must not kill renewal silently; the holder's local
                # deadline still protects it if renewals keep failing
                log.exception("watchdog_tick_failed", thread=self._thread.name)
                delay = self._interval
