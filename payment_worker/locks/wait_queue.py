"""The FIFO queue a blocking acquire of an account lock waits in.

A waiter enters the account's queue (``lock_wait.lua``: the lock is granted at once if it is
free and nobody waits before it), then blocks on a list of its own (``BLPOP``) that a
releasing holder pushes to when it hands the lock straight over. Each wake, and each slice
that ends without one (a dead holder, a lost wake), asks the script again; a waiter that
stops asking (killed, paused) is skipped after its lease. A slice that ends without a wake
also asks whether the lock's holder is dead (``check``: its liveness key gone), and takes
its lock over: a lock handed to a waiter that died would otherwise hold the queue for its
whole TTL. Giving up on time cancels the place (``lock_cancel.lua``), and keeps a lock
handed over meanwhile; giving up on an error leaves the queue and gives back anything
handed over (``leave``). docs/locks.md has the keys and the scripts' rules.
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from payment_worker import lua
from payment_worker.locks.watchdog import clock as _clock
from payment_worker.redis_keys import RedisKeys

# The scripts run with KEYS = [lock, waiter queue, waiter leases]; headers in the files.
_WAIT_LUA = lua.load("lock_wait")
_CANCEL_LUA = lua.load("lock_cancel")


class WaitQueue:
    """One account's waiter queue, for the lock whose scripts take ``script_keys`` (the
    lock, its waiter queue, the waiters' leases).

    ``leave(token, error)``: a waiter that gives up on ``error`` leaves the queue and gives
    back a lock handed to it (never raises). ``check(token, sent)``: at a slice's end with
    no wake, take the lock over when its holder is dead; the clock reading before the
    granting command, or None (None: no check)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        account_id: str,
        script_keys: list[str],
        ttl_ms: int,
        leave: Callable[[str, BaseException], None],
        check: Callable[[str, float], float | None] | None = None,
    ) -> None:
        self.account_id = account_id
        self.ttl_ms = ttl_ms
        self.keys = script_keys
        self._redis = client
        self._redis_keys = keys
        self._wait = client.register_script(_WAIT_LUA)
        self._cancel = client.register_script(_CANCEL_LUA)
        self._leave = leave
        self._check = check

    def slice_seconds(self) -> float:
        """How long one BLPOP blocks before a fallback check (a dead holder, a lost wake)."""
        slice_s = max(0.05, self.ttl_ms / 3000)
        socket_timeout = self._redis.connection_pool.connection_kwargs.get("socket_timeout")
        if socket_timeout:
            # the BLPOP must return before the client gives up on the socket
            slice_s = min(slice_s, max(0.01, float(socket_timeout) * 0.8))
        return slice_s

    def wait(self, token: str, until: float | None) -> float | None:
        """Wait for the lock as ``token`` until the clock reads ``until`` (None: for ever);
        the clock reading taken before the granting command, or None (not granted)."""
        slice_s = self.slice_seconds()
        # a waiter that stops refreshing (killed, paused) is skipped after its lease
        lease_ms = int((2 * slice_s + 1.0) * 1000)
        keys = self.keys
        wake_key = self._redis_keys.lock_wake(self.account_id, token)
        try:
            sent = _clock()
            if self._wait(keys=keys, args=[token, self.ttl_ms, lease_ms]) == 1:
                return sent
            while True:
                remaining = None if until is None else until - _clock()
                if remaining is not None and remaining <= 0:
                    break
                block = slice_s if remaining is None else min(slice_s, remaining)
                # Redis reads a BLPOP timeout below 1 ms as 0, which blocks forever
                woke = self._redis.blpop([wake_key], timeout=max(0.01, block))
                sent = _clock()
                if self._wait(keys=keys, args=[token, self.ttl_ms, lease_ms]) == 1:
                    return sent
                if woke is None and self._check is not None:
                    granted = self._check(token, sent)
                    if granted is not None:
                        # taken over: ours, and our place in the queue is left
                        self._cancel(keys=keys, args=[token, self.ttl_ms])
                        return granted
            sent = _clock()
            if self._cancel(keys=keys, args=[token, self.ttl_ms]) == 1:
                return sent
        except BaseException as exc:
            self._leave(token, exc)
            raise
        return None
