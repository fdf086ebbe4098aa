"""``payment-worker demo --chaos``: kill one worker and pause another while they hold locks.

A fault proves something only if it hits a lock holder, so each victim is chosen the way
``tests/chaos/test_chaos.py`` does it: a candidate is stopped (SIGSTOP) and kept only if
some account lock it held is then left unrenewed (a live holder renews at TTL/3). The
killed worker is replaced by a fresh one; the paused one is resumed after more than the
lock TTL, when another worker may already own its accounts, so its late writes meet the
fence. Runs in a thread beside the progress display; every step is logged as an event.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import redis

from payment_worker.dev.local_cluster import ManagedProcess
from payment_worker.redis_keys import RedisKeys


class Chaos(threading.Thread):
    """Kill a lock holder (and start a replacement), then pause another past the lock TTL."""

    def __init__(
        self,
        *,
        redis_client: redis.Redis,
        keys: RedisKeys,
        accounts: list[str],
        lock_ttl_ms: int,
        workers: Callable[[], list[ManagedProcess]],
        start_worker: Callable[[], ManagedProcess],
        started: Callable[[], bool],
        work_left: Callable[[], bool],
        seed: int = 7,
    ) -> None:
        super().__init__(name="demo-chaos", daemon=True)
        self._redis = redis_client
        self._keys = [keys.lock(a) for a in accounts]
        self._ttl = lock_ttl_ms / 1000
        self._workers = workers
        self._start_worker = start_worker
        self._work_started = started
        self._work_left = work_left
        self._rng = random.Random(seed)
        self._t0 = time.monotonic()
        self.stopping = threading.Event()
        self.events: list[str] = []
        self.paused: ManagedProcess | None = None
        self.killed: list[str] = []

    def _event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self._t0:5.1f} s  {text}")

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless the demo is stopping; False when it is."""
        return not self.stopping.wait(seconds)

    def _held(self) -> dict[str, object]:
        values = self._redis.mget(self._keys)
        return {k: v for k, v in zip(self._keys, values, strict=True) if v is not None}

    def _stop_a_holder(self) -> tuple[ManagedProcess, int] | None:
        """SIGSTOP workers in turn until one is shown to hold locks; it stays stopped."""
        candidates = self._workers()
        self._rng.shuffle(candidates)
        for proc in candidates:
            if self.stopping.is_set():
                return None
            held = self._held()
            proc.pause()
            if not self._sleep(self._ttl * 0.6):
                proc.resume()
                return None
            left = sum(
                1
                for key, token in held.items()
                if self._redis.get(key) == token and 0 <= self._redis.pttl(key) < self._ttl * 500
            )
            if left:
                return proc, left
            proc.resume()
        return None

    def _find_holder(self, patience: float = 30.0) -> tuple[ManagedProcess, int] | None:
        """Look for a lock holder to stop until one is found, the work is done or
        ``patience`` runs out. Right after a kill, no lock may be held for a while (the dead
        holder's locks expire, then the sweeper gives the accounts out again)."""
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline and self._work_left():
            hit = self._stop_a_holder()
            if hit is not None or not self._sleep(0.3):
                return hit
        return None

    def run(self) -> None:
        """The chaos schedule: wait for work in progress, kill, then pause."""
        try:
            self._run()
        except Exception as exc:  # a chaos step that fails must not hang the demo
            self._event(f"chaos stopped early: {type(exc).__name__}: {exc}")

    def _run(self) -> None:
        while not self._work_started():
            if not self._sleep(0.2):
                return
        self._t0 = time.monotonic()
        hit = self._find_holder()
        if hit is None:
            self._event("kill skipped: no worker held an account lock")
        else:
            victim, held = hit
            victim.kill()
            self.killed.append(victim.name)
            fresh = self._start_worker()
            self._event(
                f"SIGKILL {victim.name} (it held {held} account lock(s), left to expire); "
                f"{fresh.name} started"
            )
        if not self._sleep(0.5):
            return
        hit = self._find_holder()
        if hit is None:
            self._event("pause skipped: no worker held an account lock")
            return
        victim, held = hit
        self.paused = victim
        pause = self._ttl + 2.0  # with the 0.6 x TTL already spent: well past the TTL
        self._event(
            f"SIGSTOP {victim.name} for {pause + self._ttl * 0.6:.1f} s "
            f"(lock TTL {self._ttl:g} s; it held {held} account lock(s))"
        )
        self._sleep(pause)
        victim.resume()
        self.paused = None
        self._event(
            f"SIGCONT {victim.name}: it finds its locks gone (a late write would meet the fence)"
        )

    def stop(self) -> None:
        """End the schedule now and resume a worker left paused."""
        self.stopping.set()
        if self.ident is not None:  # started
            self.join(timeout=10)
        if self.paused is not None:
            self.paused.resume()
