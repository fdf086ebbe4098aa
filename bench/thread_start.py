"""CPU of a new thread's first Redis command, by pool (issue 13).

    .venv/bin/python bench/thread_start.py [--threads 500] [--rounds 3]

A Celery threads worker starts a thread for each task that finds no idle one: at 100 ms
gateway latency nearly every account of a fresh worker runs on a new thread. Each row
starts ``--threads`` threads one after another, each running one ``GET`` and ending, and
divides this process's CPU (user + system) by the threads:

- a bare thread (no command): the floor;
- the runtime's client (:func:`payment_worker.redis_pool.sharded_client`): threads dealt
  over 32 redis-py pools, whose connections the next threads reuse;
- a redis-py pool per thread, built as ``redis_pool`` built them before it sharded
  (d5bebf9 and earlier): each thread opens its own connection, and redis-py reads its
  package metadata for each;
- the same with the driver info resolved once (what ``sharded_client`` passes).

Medians of ``--rounds``. Uses REDIS_URL when set, else the embedded Redis (db 13, flushed).
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import threading
from collections.abc import Callable
from typing import Any

from _env import git_rev, machine, scratch


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_thread_client(url: str, **kwargs: Any) -> Callable[[], None]:
    """A GET on a pool of the calling thread's own (the old ``ThreadLocalConnectionPool``)."""
    import redis

    local = threading.local()
    pools: list[redis.ConnectionPool] = []  # kept, as the old pool's thread did, until the end

    def get() -> None:
        client = getattr(local, "client", None)
        if client is None:
            pool = redis.ConnectionPool.from_url(url, **kwargs)
            pools.append(pool)
            client = local.client = redis.Redis(connection_pool=pool)
        client.get("pw-bench-thread-start")

    get.pools = pools  # type: ignore[attr-defined]
    return get


def measure(fn: Callable[[], None], threads: int) -> float:
    """CPU µs per thread started, ``fn`` run once in each, one thread at a time."""
    t0 = _cpu()
    for _ in range(threads):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    return (_cpu() - t0) / threads * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import redis

    from payment_worker.redis_pool import driver_info, sharded_client

    with scratch() as (_db, redis_url, _broker):
        redis.Redis.from_url(redis_url).flushdb()
        rows: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            cases: dict[str, Callable[[], None]] = {}
            cases["bare thread"] = lambda: None
            shared = sharded_client(redis_url, health_check_interval=10)
            cases["runtime's client (32 shared pools)"] = functools.partial(  # type: ignore[assignment]
                shared.get, "pw-bench-thread-start"
            )
            own = per_thread_client(redis_url, health_check_interval=10)
            cases["a pool per thread (d5bebf9)"] = own
            own_info = per_thread_client(
                redis_url, health_check_interval=10, driver_info=driver_info()
            )
            cases["a pool per thread, driver info once"] = own_info
            for name, fn in cases.items():
                rows.setdefault(name, []).append(measure(fn, args.threads))
            shared.close()
            for get in (own, own_info):
                for pool in get.pools:  # type: ignore[attr-defined]
                    pool.disconnect()
        print(f"# thread start  machine: {machine()}  commit: {git_rev()}")
        print(f"# {args.threads} threads one after another, medians of {args.rounds} rounds")
        print()
        print("| pool | CPU µs per new thread and its first GET | rounds |")
        print("|---|---|---|")
        for name, values in rows.items():
            spread = " / ".join(f"{v:,.0f}" for v in values)
            print(f"| {name} | **{statistics.median(values):,.0f}** | {spread} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
