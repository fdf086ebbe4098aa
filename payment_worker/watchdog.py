"""A background renewal thread that stops the moment it is told to (an Event, never a sleep)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from payment_worker.observability.logging import get_logger

log = get_logger("watchdog")

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
