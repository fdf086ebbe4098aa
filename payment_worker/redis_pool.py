"""Redis connection pools in shards, behind one pool object.

redis-py's ``ConnectionPool`` guards its free list with one lock per pool, taken twice per
command (get and release). A worker process runs hundreds of task threads on one client:
when the thread holding that lock loses the GIL inside it, every thread that needs Redis
queues behind it until the holder runs again, which with hundreds of runnable threads takes
many switch intervals. Profiled in issue 13's scenario 5 (2,000 accounts at 1 s gateway
latency, 500 threads per process), 80 % of a worker's busy samples were threads waiting in
``get_connection``/``release``.

A pool per thread removed that wait but bound every connection to its thread, and a Celery
threads worker starts a new thread for each task that finds no idle one: at 100 ms gateway
latency nearly every account ran on a fresh thread, which opened its own connection (a TCP
connect, ``HELLO``, ``CLIENT SETINFO`` twice, ``SELECT``: about 1.5 ms of CPU, more than the
account's own Redis work). Here the threads are dealt round robin over :data:`SHARDS` plain
pools (built exactly as redis-py would build this one): a lock is shared by a few dozen
threads instead of hundreds, and a connection one thread leaves idle serves the next thread
of its shard, so a process opens about as many connections as it has Redis commands in
flight at once, plus at most one idle per shard.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import redis

# threads per pool lock: a 1,000-slot worker puts about 31 threads on each
SHARDS = 32

#: errors of a Redis that could not be reached: refused, reset, timed out, still loading. A
#: command that failed this way may have run on the server (only its reply lost) or not.
#: The clients here make no retries of their own (redis-py 8 gives a connection built from
#: a pool's URL none), so the callers decide what a failed round trip means.
UNREACHABLE: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


def driver_info() -> Any:
    """redis-py's client identification (``CLIENT SETINFO``), resolved now, to be shared by
    every connection of a pool.

    Left to itself, redis-py resolves it for every new connection by reading its own
    package metadata (``importlib.metadata``, an email-header parse): about half a
    millisecond of CPU a connection. None with a redis-py that has no ``DriverInfo``.
    """
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py before 7.1: nothing to pass
        return None
    return DriverInfo()


class ShardedConnectionPool(redis.ConnectionPool):
    """A ``redis.ConnectionPool`` whose connections live in ``shards`` plain sub-pools.

    Build it like redis-py's (``from_url`` included). Each thread keeps to one sub-pool,
    assigned round robin at its first command; a connection goes back to the sub-pool it
    came from, whichever thread releases it. ``disconnect``/``close`` reach every
    sub-pool's connections; ``reset`` (a forked child) forgets them without closing the
    parent's sockets, as redis-py's own pool does. ``max_connections`` bounds each sub-pool
    (redis-py's default, 100 in redis-py 8, is far above a sub-pool's few dozen threads).
    """

    def __init__(self, *args: Any, shards: int = SHARDS, **kwargs: Any) -> None:
        if shards < 1:
            raise ValueError("shards must be at least 1")
        self._local = threading.local()
        self._deal = itertools.count()  # next() is atomic under the GIL
        self._shards = [redis.ConnectionPool(*args, **kwargs) for _ in range(shards)]
        super().__init__(*args, **kwargs)

    def _sub(self) -> redis.ConnectionPool:
        pool: redis.ConnectionPool | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._shards[next(self._deal) % len(self._shards)]
            self._local.pool = pool
        return pool

    def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        """A connection of the calling thread's sub-pool."""
        pool = self._sub()
        # redis-py deprecates the arguments (5.3); pass them on only when a caller gave some
        args = (command_name, *keys) if command_name is not None or keys else ()
        conn: Any = pool.get_connection(*args, **options)
        conn._pw_pool = pool  # released to its own sub-pool, whichever thread releases it
        return conn

    def release(self, connection: Any) -> None:
        """Back to the sub-pool it came from."""
        pool = getattr(connection, "_pw_pool", None)
        if pool is None:
            super().release(connection)
        else:
            pool.release(connection)

    def open_idle(self, count: int) -> int:
        """Open ``count`` connections now, dealt round robin over the sub-pools, and leave
        them idle in their sub-pools; returns how many were opened.

        Why: a connection costs a TCP connect, ``HELLO``, ``CLIENT SETINFO`` twice and
        ``SELECT`` (about 1 ms of CPU). A fresh worker met by a burst of accounts opened a
        hundred or more of them among its busy task threads; opened before its first task,
        they cost the burst nothing (issue 13, docs/benchmarks.md, "Thirtieth session")."""
        taken: list[tuple[redis.ConnectionPool, Any]] = []
        try:
            for i in range(count):
                pool = self._shards[i % len(self._shards)]
                taken.append((pool, pool.get_connection()))  # connected, and checked
        finally:
            for pool, conn in taken:
                pool.release(conn)
        return len(taken)

    def disconnect(self, inuse_connections: bool = True) -> None:
        """Disconnect every sub-pool's connections."""
        for pool in self._shards:
            pool.disconnect(inuse_connections)
        super().disconnect(inuse_connections)

    def reset(self) -> None:
        """Forget every sub-pool's connections (after a fork: the sockets are the parent's)."""
        for pool in getattr(self, "_shards", ()):  # the base __init__ calls reset() first
            pool.reset()
        super().reset()


def sharded_client(url: str, **kwargs: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (kwargs as ``redis.Redis.from_url`` takes them) whose
    threads share connections over :data:`SHARDS` pool locks (its connections share one
    :func:`driver_info`)."""
    info = driver_info()
    if info is not None:
        kwargs.setdefault("driver_info", info)
    return redis.Redis(connection_pool=ShardedConnectionPool.from_url(url, **kwargs))
