"""A Redis connection pool per thread, behind one pool object.

redis-py's ``ConnectionPool`` guards its free list with one lock per pool, taken twice per
command (get and release). A worker process runs hundreds of task threads on one client:
when the thread holding that lock loses the GIL inside it, every thread that needs Redis
queues behind it until the holder runs again, which with hundreds of runnable threads takes
many switch intervals. Profiled in issue 13's scenario 5 (2,000 accounts at 1 s gateway
latency, 500 threads per process), 80 % of a worker's busy samples were threads waiting in
``get_connection``/``release``. Here each thread gets its own plain pool (built exactly as
redis-py would build this one), so the lock a command takes is its own thread's and never
contended; the connections are the same in number (a thread uses one at a time).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import redis


class ThreadLocalConnectionPool(redis.ConnectionPool):
    """A ``redis.ConnectionPool`` that hands each thread connections of its own sub-pool.

    Build it like redis-py's (``from_url`` included). ``disconnect``/``close`` reach every
    thread's connections; ``reset`` (a forked child) forgets them without closing the
    parent's sockets, as redis-py's own pool does. A thread's sub-pool goes with the thread.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sub_args = args
        self._sub_kwargs = dict(kwargs)
        self._subs_lock = threading.Lock()
        self._local = threading.local()
        self._subs: weakref.WeakSet[redis.ConnectionPool] = weakref.WeakSet()
        super().__init__(*args, **kwargs)

    def _sub(self) -> redis.ConnectionPool:
        pool: redis.ConnectionPool | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = redis.ConnectionPool(*self._sub_args, **self._sub_kwargs)
            self._local.pool = pool
            with self._subs_lock:
                self._subs.add(pool)
        return pool

    def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        """A connection of the calling thread's own pool."""
        pool = self._sub()
        # redis-py deprecates the arguments (5.3); pass them on only when a caller gave some
        args = (command_name, *keys) if command_name is not None or keys else ()
        conn: Any = pool.get_connection(*args, **options)
        conn._pw_pool = pool  # released to its own pool, whichever thread releases it
        return conn

    def release(self, connection: Any) -> None:
        """Back to the pool it came from."""
        pool = getattr(connection, "_pw_pool", None)
        if pool is None:
            super().release(connection)
        else:
            pool.release(connection)

    def disconnect(self, inuse_connections: bool = True) -> None:
        """Disconnect every thread's connections."""
        with self._subs_lock:
            pools = list(self._subs)
        for pool in pools:
            pool.disconnect(inuse_connections)
        super().disconnect(inuse_connections)

    def reset(self) -> None:
        """Forget every thread's pool (after a fork: the sockets are the parent's)."""
        if hasattr(self, "_subs_lock"):  # the base __init__ calls reset() first
            with self._subs_lock:
                self._local = threading.local()
                self._subs = weakref.WeakSet()
        super().reset()


def thread_local_client(url: str, **kwargs: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (kwargs as ``redis.Redis.from_url`` takes them) whose
    commands never wait on another thread's pool lock."""
    return redis.Redis(connection_pool=ThreadLocalConnectionPool.from_url(url, **kwargs))
