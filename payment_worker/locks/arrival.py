"""Work arriving with a lock attempt: the "work waiting" mark and the marks a taker clears,
written in the attempt's own round trip (``lua/lock_take.lua``); and what a drain's first
request would otherwise fetch after it (a :class:`Rider`, ``lua/account_start.lua``).

A task for an account either takes its lock or leaves a mark that the holder checks after it
releases (:mod:`payment_worker.worker.drain`). Done as three commands (mark, ``SET NX``,
delete the marks once taken) that cost every account three Redis round trips before its
first claim; the script does the same in one, atomically, which keeps the order the drain
relies on. The lock only carries the keys: what they mean belongs to the queue
(:class:`payment_worker.worker.queueing.RedisAccountQueue`).

A rider does the same for the gateway: the account's shared token and a block of its pacing
slots are read in the lock's round trip, and only when the lock is taken, instead of in two
round trips of their own before the first request. The lock only carries its keys and
arguments, and hands the answers back (:class:`payment_worker.gateway.client.StartRider`).
An end rider does the same at the release: what the holder gives back (the rest of its
pacing lease, a token refresh lock it never used) goes in the release's round trip
(:class:`EndRider`, ``lua/account_end.lua``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import redis

from payment_worker import lua

_TAKE_LUA = lua.load("lock_take")
_START_LUA = lua.load("account_start")


class Rider(Protocol):
    """What rides on a lock attempt (``lua/account_start.lua``'s KEYS[3..5], ARGV[5..9])."""

    @property
    def keys(self) -> tuple[str, str, str]:
        """The token hash, its refresh lock and the pacing state of the account."""
        ...

    @property
    def args(self) -> tuple[str | int | float, ...]:
        """The refresh lock's owner and TTL ('' and 0: no token read), the rate, slots and
        reach of the lease ('', 0, 0: no lease)."""
        ...

    def taken(self, token: list[Any], pace: list[Any]) -> None:
        """The lock was taken: the script's token and pacing answers (empty when not asked)."""
        ...


class EndRider(Protocol):
    """What rides on a lock's release (``lua/account_end.lua``'s KEYS[5..6], ARGV[3..5]):
    what the holder gives back as it lets the account go."""

    @property
    def keys(self) -> tuple[str, str]:
        """The pacing state and the token refresh lock of the account."""
        ...

    @property
    def args(self) -> tuple[bytes | str | float, ...]:
        """The lease's ``tat`` to give back ('' for none), the ms from now to the account's
        next free slot, and the refresh lock's owner value to release ('' for none)."""
        ...


@dataclass(frozen=True, slots=True)
class Arrival:
    """What a lock attempt records besides the lock (all keys in the account's slot)."""

    mark: str  # set to ``value`` for ``mark_ms`` when the lock is busy
    value: str
    mark_ms: int
    cleared: tuple[str, ...] = ()  # deleted, with ``mark``, when the lock is taken

    def take(
        self,
        client: redis.Redis,
        lock_key: str,
        token: str,
        ttl_ms: int,
        rider: Rider | None = None,
    ) -> bool:
        """``SET lock token NX PX ttl``; taken: the marks deleted, busy: the mark set. One
        round trip; True when taken. With ``rider``, the same round trip reads what it asks
        for when the lock is taken, and hands it the answers."""
        args: list[str | int | float] = [token, ttl_ms, self.value, self.mark_ms]
        if rider is None:
            script = client.register_script(_TAKE_LUA)
            return bool(script(keys=[lock_key, self.mark, *self.cleared], args=args) == 1)
        script = client.register_script(_START_LUA)
        keys = [lock_key, self.mark, *rider.keys, *self.cleared]
        reply = script(keys=keys, args=[*args, *rider.args])
        if int(reply[0]) != 1:
            return False
        rider.taken(reply[1], reply[2])
        return True

    def leave_mark(self, client: redis.Redis) -> None:
        """The lock was not tried (or is busy): leave the mark for its holder."""
        client.set(self.mark, self.value, px=self.mark_ms)

    def clear(self, client: redis.Redis) -> None:
        """The lock was taken another way (a dead holder's, a hand-over): clear the marks."""
        client.delete(self.mark, *self.cleared)
