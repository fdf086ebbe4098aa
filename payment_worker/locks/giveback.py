"""Locks given back later: a release, or a take's undo, whose round trip to Redis failed.

A holder that cannot reach Redis when it lets go leaves its lock in Redis for the rest of the
lock's TTL (30 s by default): every other process finds the lock's holder alive and leaves
the account alone, so a blip of a second would stall the account for half a minute. The
lock's value is still known, so the release is tried again here, owner-checked (a lock that
is no longer ours is never touched), from one daemon thread per process, with a growing
pause, until it goes through or the lock's TTL has run out (the key is gone then anyway).

A take whose round trip failed may have run (its reply lost) or not: its value is given back
the same way, so a lock the taker does not know it holds is not left behind either.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from payment_worker.locks.watchdog import DueLoop, clock
from payment_worker.ops.logging import get_logger

log = get_logger("locks")

#: the pause before the first retry, and the most it grows to (doubling)
FIRST_DELAY = 0.1
MAX_DELAY = 1.0

#: what an attempt's answer means (``lock_release.lua``'s codes)
_RESULTS = {1: "released", 2: "handed_over", 0: "gone", -1: "not_ours"}


@dataclass(slots=True)
class _Pending:
    account_id: str
    attempt: Callable[[], int]  # the owner-checked release; raises RedisError on failure
    until: float  # past this the lock has expired: nothing left to give back
    due: float
    delay: float = FIRST_DELAY
    tries: int = 0


class GiveBack(DueLoop):
    """The process's queue of locks to give back, and the thread that retries them.

    The thread starts with the first entry and ends once nothing was pending for ``linger``
    seconds. ``threaded=False`` starts none: the caller drives :meth:`run_due` (tests).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = clock,
        linger: float = 5.0,
        threaded: bool = True,
    ) -> None:
        self._clock = clock
        self._linger = linger
        self._threaded = threaded
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, account_id: str, attempt: Callable[[], int], ttl_s: float) -> None:
        """Retry ``attempt`` (an owner-checked release answering ``lock_release.lua``'s code)
        until it goes through or ``ttl_s`` seconds from now have passed."""
        if self._pid != os.getpid():
            self._reset()  # forked: the parent's thread and entries are not ours
        now = self._clock()
        entry = _Pending(account_id, attempt, until=now + ttl_s, due=now + FIRST_DELAY)
        log.warning("lock_give_back_pending", account_id=account_id, within_s=round(ttl_s, 3))
        with self._cond:
            self._closed = False
            self._pending.append(entry)
            if self._threaded:
                self._start("lock-giveback")
            self._cond.notify()

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Forget what is pending (the end of the process's runtime: its locks expire)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()

    def run_due(self) -> None:
        """Try every entry that is due now (the thread calls this; tests may by hand). The
        first failure puts the rest off too: Redis is not answering, and a hung server would
        hold each try for the client's socket timeout."""
        now = self._clock()
        with self._cond:
            due = [e for e in self._pending if e.due <= now]
            self._pending = [e for e in self._pending if e.due > now]
        failed: Exception | None = None
        for entry in due:
            if failed is None:
                entry.tries += 1
                try:
                    code = entry.attempt()
                except RedisError as exc:
                    failed = exc
                else:
                    log.info(
                        "lock_given_back",
                        account_id=entry.account_id,
                        result=_RESULTS.get(code, str(code)),
                        tries=entry.tries,
                    )
                    continue
            self._retry_later(entry, failed)

    def _retry_later(self, entry: _Pending, error: Exception) -> None:
        if self._clock() + entry.delay >= entry.until:
            # the lock's TTL runs out before the next try: it frees itself
            log.warning(
                "lock_give_back_expired",
                account_id=entry.account_id,
                tries=entry.tries,
                error=str(error),
            )
            return
        entry.due = self._clock() + entry.delay
        entry.delay = min(entry.delay * 2, MAX_DELAY)
        with self._cond:
            self._pending.append(entry)

    def _next_due(self) -> float | None:
        return min((e.due for e in self._pending), default=None)

    def _tick(self) -> None:
        try:
            self.run_due()
        except Exception:
            log.exception("lock_giveback_failed")
