"""Work arriving with a lock attempt: the "work waiting" mark and the marks a taker clears,
written in the attempt's own round trip (``lua/lock_take.lua``).

A task for an account either takes its lock or leaves a mark that the holder checks after it
releases (:mod:`payment_worker.worker.drain`). Done as three commands (mark, ``SET NX``,
delete the marks once taken) that cost every account three Redis round trips before its
first claim; the script does the same in one, atomically, which keeps the order the drain
relies on. The lock only carries the keys: what they mean belongs to the queue
(:class:`payment_worker.worker.queueing.RedisAccountQueue`).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from payment_worker import lua

_TAKE_LUA = lua.load("lock_take")


@dataclass(frozen=True, slots=True)
class Arrival:
    """What a lock attempt records besides the lock (all keys in the account's slot)."""

    mark: str  # set to ``value`` for ``mark_ms`` when the lock is busy
    value: str
    mark_ms: int
    cleared: tuple[str, ...] = ()  # deleted, with ``mark``, when the lock is taken

    def take(self, client: redis.Redis, lock_key: str, token: str, ttl_ms: int) -> bool:
        """``SET lock token NX PX ttl``; taken: the marks deleted, busy: the mark set. One
        round trip; True when taken."""
        script = client.register_script(_TAKE_LUA)
        keys = [lock_key, self.mark, *self.cleared]
        return bool(script(keys=keys, args=[token, ttl_ms, self.value, self.mark_ms]) == 1)

    def leave_mark(self, client: redis.Redis) -> None:
        """The lock was not tried (or is busy): leave the mark for its holder."""
        client.set(self.mark, self.value, px=self.mark_ms)

    def clear(self, client: redis.Redis) -> None:
        """The lock was taken another way (a dead holder's, a hand-over): clear the marks."""
        client.delete(self.mark, *self.cleared)
