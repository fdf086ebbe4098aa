"""Account lock benchmark: round trips, latency and contended throughput, side by side.

Compares ``payment_worker.locks.account_lock.AccountLock`` (with its Postgres fencing token) with
redis-py's ``Lock`` and python-redis-lock (auto renewal on). Uses DATABASE_URL / REDIS_URL
(or the embedded servers); the database must be migrated (``payment-worker db upgrade``).
Every key it writes carries a ``bench-<pid>`` prefix and is deleted at the end.

    python bench/locks.py [--cycles 2000] [--duration 3] [--contenders 1,8,64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg  # noqa: F401  (imported before forking: children start warm)
import redis
import redis_lock
import sqlalchemy.dialects.postgresql.psycopg  # noqa: F401
from sqlalchemy import event, text
from sqlalchemy.pool import Pool

from payment_worker.db.engine import make_engine
from payment_worker.locks.account_lock import AccountLock
from payment_worker.ops.logging import configure_logging
from payment_worker.runtime import ServiceUrls
from payment_worker.settings import load_settings

PREFIX = f"bench-{os.getpid()}"


def redis_url() -> str:
    """The service's Redis (the settings' URL, or the embedded server)."""
    return ServiceUrls.resolve(load_settings()).redis


def sqlalchemy_url() -> str:
    """The service's database in SQLAlchemy form."""
    return ServiceUrls.resolve(load_settings()).sqlalchemy


TTL_MS = 30_000


class CountingConnection(redis.Connection):
    """Counts Redis round trips: one per packed send (a pipeline is one)."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


class PgTrace:
    """Counts Postgres round trips from the libpq protocol trace (one per Sync or Query)."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="pw-bench-pgtrace-")
        self._fh = os.fdopen(fd, "w")
        event.listen(Pool, "connect", self._on_connect)

    def _on_connect(self, dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.pgconn.trace(self._fh.fileno())

    def reset(self) -> None:
        self._fh.flush()
        os.truncate(self.path, 0)
        self._fh.seek(0)

    def round_trips(self) -> int:
        self._fh.flush()
        lines = Path(self.path).read_text().splitlines()
        return sum(1 for ln in lines if "\tF\t" in ln and ("\tSync" in ln or "\tQuery" in ln))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _lock_factory(kind: str, r: redis.Redis, engine: Any, name: str) -> Callable[[], Any]:
    if kind == "AccountLock (+fence)":
        return lambda: AccountLock(
            r, name, engine=engine, ttl_ms=TTL_MS, safety_margin_ms=1000, key_prefix=PREFIX
        )
    if kind == "redis-py Lock":
        return lambda: r.lock(f"{PREFIX}:rp:{name}", timeout=TTL_MS / 1000)
    return lambda: redis_lock.Lock(r, f"{PREFIX}:{name}", expire=TTL_MS // 1000, auto_renewal=True)


KINDS = ("AccountLock (+fence)", "redis-py Lock", "python-redis-lock")


def uncontended(cycles: int) -> list[dict[str, Any]]:
    pool = redis.ConnectionPool.from_url(redis_url(), connection_class=CountingConnection)
    r = redis.Redis(connection_pool=pool)
    trace = PgTrace()
    engine = make_engine(sqlalchemy_url())
    rows = []
    for kind in KINDS:
        make = _lock_factory(kind, r, engine, f"{PREFIX}-uncontended")
        for _ in range(50):  # warm up: connections, script cache, fence engine
            lock = make()
            lock.acquire()
            lock.release()
        CountingConnection.sends = 0
        trace.reset()
        acq, rel, total = [], [], []
        for _ in range(cycles):
            lock = make()
            t0 = time.perf_counter()
            assert lock.acquire(blocking=False)
            t1 = time.perf_counter()
            lock.release()
            t2 = time.perf_counter()
            acq.append(t1 - t0)
            rel.append(t2 - t1)
            total.append(t2 - t0)
        rows.append(
            {
                "lock": kind,
                "redis_rt": CountingConnection.sends / cycles,
                "pg_rt": trace.round_trips() / cycles,
                "cycle_p50_ms": pct(total, 0.5) * 1000,
                "cycle_p99_ms": pct(total, 0.99) * 1000,
                "acquire_p50_ms": pct(acq, 0.5) * 1000,
                "release_p50_ms": pct(rel, 0.5) * 1000,
                "release_p99_ms": pct(rel, 0.99) * 1000,
            }
        )
    engine.dispose()
    return rows


def _contender(kind: str, duration: float, out: Path, go_key: str) -> None:
    r = redis.Redis.from_url(redis_url(), socket_timeout=30)
    engine = make_engine(sqlalchemy_url(), pool_size=1)
    make = _lock_factory(kind, r, engine, f"{PREFIX}-contended")
    warm = _lock_factory(kind, r, engine, f"{PREFIX}-warm-{os.getpid()}")()
    warm.acquire()
    warm.release()
    r.incr(f"{go_key}:ready")
    r.blpop([go_key], timeout=25)
    count, waits = 0, []
    end = time.monotonic() + duration
    while time.monotonic() < end:
        lock = make()
        t0 = time.monotonic()
        if kind == "redis-py Lock":
            ok = lock.acquire(blocking=True, blocking_timeout=10)
        else:
            ok = lock.acquire(blocking=True, timeout=10)
        if not ok:
            continue
        waits.append(time.monotonic() - t0)
        lock.release()
        count += 1
    out.write_text(json.dumps({"count": count, "max_wait": max(waits, default=0.0)}))


def contended(kind: str, n: int, duration: float) -> dict[str, Any]:
    r = redis.Redis.from_url(redis_url())
    go_key = f"{PREFIX}:go:{n}:{KINDS.index(kind)}"
    with tempfile.TemporaryDirectory() as tmp:
        pids = []
        for i in range(n):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _contender(kind, duration, Path(tmp, f"{i}.json"), go_key)
                except BaseException as exc:
                    print(f"contender failed: {exc!r}", file=sys.stderr)
                    code = 1
                os._exit(code)
            pids.append(pid)
        while int(r.get(f"{go_key}:ready") or 0) < n:
            time.sleep(0.02)
        r.rpush(go_key, *([1] * n))
        for pid in pids:
            os.waitpid(pid, 0)
        results = [json.loads(p.read_text()) for p in Path(tmp).glob("*.json")]
    counts = [res["count"] for res in results]
    return {
        "lock": kind,
        "contenders": n,
        "acq_per_s": sum(counts) / duration,
        "min_per_proc": min(counts),
        "max_per_proc": max(counts),
        "max_wait_s": max(res["max_wait"] for res in results),
    }


def table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    cells = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--contenders", default="1,8,64")
    args = parser.parse_args()
    configure_logging("WARNING")
    try:
        print(f"uncontended cycle (acquire + fence + release), {args.cycles} cycles, TTL 30 s")
        print(table(uncontended(args.cycles)))
        print()
        print(f"contended: N processes loop blocking acquire + release for {args.duration} s")
        rows = [
            contended(kind, int(n), args.duration)
            for n in args.contenders.split(",")
            for kind in KINDS
        ]
        print(table(rows))
    finally:
        r = redis.Redis.from_url(redis_url())
        keys = [k for pat in ("", "lock:", "lock-signal:") for k in r.scan_iter(f"{pat}{PREFIX}*")]
        if keys:
            r.delete(*keys)
        # the fencing rows of the bench's own made-up accounts
        with make_engine(sqlalchemy_url()).begin() as conn:
            conn.execute(
                text("DELETE FROM account_fences WHERE account_id LIKE :p"), {"p": f"{PREFIX}-%"}
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
