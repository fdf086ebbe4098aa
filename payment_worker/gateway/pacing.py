"""Per-account request pacing shared by every worker process: a token bucket in Redis.

One Lua script takes a slot atomically, on the Redis server's clock (so processes on hosts
with skewed clocks agree). A 429's ``Retry-After`` is recorded in the same key as a
cooldown: no process takes a slot for that account before it has passed.

Key: ``{prefix}:pace:{account}`` (a hash: ``tokens``, ``ts``, ``until``; the ``{account}``
hash tag keeps all of an account's keys in one Redis Cluster slot).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from payment_worker import lua
from payment_worker.ops.metrics import GATEWAY_PACING_WAIT_SECONDS
from payment_worker.redis_keys import RedisKeys

# take a slot (0, or the ms to wait) and record a 429's cooldown, on the server's clock
_ACQUIRE = lua.load("pace_acquire")
_COOLDOWN = lua.load("pace_cooldown")


@dataclass(frozen=True, slots=True)
class PaceResult:
    """The outcome of waiting for a slot: taken, or given up after ``waited`` seconds."""

    acquired: bool
    waited: float
    retry_after: float = 0.0  # when not acquired: how long the account is still closed


class Pacer:
    """A per-account token bucket shared through Redis; thread-safe."""

    def __init__(
        self,
        redis_client: redis.Redis,
        prefix: str = "pw",
        burst: float = 1.0,
        max_poll: float = 0.25,
    ) -> None:
        # burst 1: strict spacing of 1/rate, which any gateway-side window of `rate`/s accepts
        self._redis = redis_client
        self._keys = RedisKeys(prefix)
        self._burst = burst
        self._max_poll = max_poll
        self._acquire = redis_client.register_script(_ACQUIRE)
        self._cooldown = redis_client.register_script(_COOLDOWN)

    def key(self, account_id: str) -> str:
        """The Redis key of an account's bucket."""
        return self._keys.pace(account_id)

    def try_acquire(self, account_id: str, rate: float) -> float:
        """Take a slot now if one is free: 0.0, else the seconds to wait before asking again."""
        wait_ms = int(self._acquire(keys=[self.key(account_id)], args=[rate, self._burst]))
        return wait_ms / 1000.0

    def acquire(self, account_id: str, rate: float, max_wait: float) -> PaceResult:
        """Wait for a slot of ``account_id`` at ``rate`` requests/s, at most ``max_wait`` s.

        Gives up at once, without sleeping, when the account is closed (a 429 cooldown or a
        queue) for longer than ``max_wait``; the caller reschedules instead of blocking.
        """
        start = time.monotonic()
        while True:
            wait = self.try_acquire(account_id, rate)
            waited = time.monotonic() - start
            if wait <= 0:
                GATEWAY_PACING_WAIT_SECONDS.observe(waited)
                return PaceResult(True, waited)
            if waited + wait > max_wait:
                GATEWAY_PACING_WAIT_SECONDS.observe(waited)
                return PaceResult(False, waited, retry_after=wait)
            # poll again: another process may take the slot first, and a 429 may close it
            time.sleep(min(wait, self._max_poll))

    def cooldown(self, account_id: str, seconds: float) -> float:
        """Close the account for ``seconds`` in every process (a 429's Retry-After)."""
        ms = max(1, int(seconds * 1000))
        return int(self._cooldown(keys=[self.key(account_id)], args=[ms])) / 1000.0
