"""Thousands of held locks in one process: one renewal thread, one round trip per tick.

Real Redis and Postgres. 2,000 account locks share the process's renewer (as the Runtime's
locks do): every lock stays renewed, only one thread renews them, the Redis commands per
second stay within what one renewal per lock per TTL/3 costs (counted by the server, for
the renewer's own connections: MONITOR, so that another client of the shared server counts
for nothing), a lost or stolen key among them is noticed at once, and a release stops that
lock's renewal while the others go on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine

from payment_worker.db.engine import autocommit, make_engine
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.watchdog import COALESCE_FRACTION, Renewer, renewal_client
from tests.conftest import PwEnv, wait_until

# run alone, after the parallel part of `make test`: its MONITOR streams every client's commands,
# and it bounds the renewer's round trips in time
pytestmark = pytest.mark.exclusive

LOCKS = 2000
TTL_MS = 3000  # a renewal per lock every second
INTERVAL = TTL_MS / 3000


@pytest.fixture
def engine(pw_env: PwEnv) -> Iterator[Engine]:
    # the fencing upsert's engine in the service: an autocommit view of the pool
    eng = autocommit(
        make_engine(pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    )
    yield eng
    eng.dispose()


RENEWER_NAME = "renewal-scale"  # CLIENT SETNAME of the renewer's connections
# what redis-py sends when it opens a connection, before any renewal
_SETUP = {"HELLO", "CLIENT", "SELECT", "AUTH", "PING"}


class _Monitor(threading.Thread):
    """Every command the server runs while it listens (MONITOR): (client address, command)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self._client = redis.Redis.from_url(url)
        self.seen: list[tuple[bytes, bytes]] = []
        self.listening = threading.Event()
        self._stopping = threading.Event()

    def run(self) -> None:
        with self._client.monitor() as m:
            self.listening.set()
            while not self._stopping.is_set():
                line = m.connection.read_response()
                if isinstance(line, bytes) and b"] " in line:
                    # 1733068800.123456 [0 127.0.0.1:40000] "EVALSHA" "…" …
                    head, _, rest = line.partition(b"] ")
                    addr = head.rpartition(b" ")[2]
                    self.seen.append((addr, rest.split(b" ", 1)[0].strip(b'"').upper()))

    def stop(self, wake: redis.Redis) -> None:
        self._stopping.set()
        wake.ping()  # the monitor reads one more line and sees the flag
        self.join(timeout=10)


def _renewer_commands(mon: _Monitor, r: redis.Redis) -> dict[bytes, int]:
    addrs = {c["addr"].encode() for c in r.client_list() if c.get("name") == RENEWER_NAME}
    counts: dict[bytes, int] = {}
    for addr, command in mon.seen:
        if addr in addrs:
            counts[command] = counts.get(command, 0) + 1
    return counts


def _renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lock-renewer")]


def test_two_thousand_locks_one_thread_bounded_commands(
    pw_env: PwEnv, redis_client: redis.Redis, engine: Engine
) -> None:
    # the renewer's connections carry a name, to tell its commands from any other client's
    named = redis.Redis.from_url(pw_env.redis_url, client_name=RENEWER_NAME)
    renewer = Renewer(renewal_client(named, TTL_MS))
    lost: dict[str, str] = {}
    locks = [
        AccountLock(
            redis_client,
            f"acct-{i:05d}",
            engine=engine,
            ttl_ms=TTL_MS,
            safety_margin_ms=500,
            renewer=renewer,
            on_lost=lambda reason, i=i: lost.__setitem__(f"acct-{i:05d}", reason),
        )
        for i in range(LOCKS)
    ]
    threads_before = len(threading.enumerate())
    monitors: list[_Monitor] = []
    try:
        for lock in locks:
            assert lock.acquire()
        assert len(renewer) == LOCKS
        assert len(_renewer_threads()) == 1
        assert len(threading.enumerate()) == threads_before + 1

        # hold for four intervals and count what the server sees of the renewer
        hold = 4 * INTERVAL
        mon = _Monitor(pw_env.redis_url)
        monitors.append(mon)
        mon.start()
        assert mon.listening.wait(10)
        batches0, sent0 = renewer.batches, renewer.renewals
        t0 = time.monotonic()
        end = t0 + hold
        while time.monotonic() < end:
            time.sleep(0.2)
            for lock in locks[::100]:
                lock.progress()
                lock.ensure_held()
        elapsed = time.monotonic() - t0
        batches, sent = renewer.batches - batches0, renewer.renewals - sent0
        mon.stop(redis_client)
        by_command = _renewer_commands(mon, redis_client)
        evalsha = by_command.pop(b"EVALSHA", 0)
        print(
            f"\n{LOCKS} locks, TTL {TTL_MS} ms, {elapsed:.2f} s: {sent} renewals in {batches}"
            f" round trips, the renewer's EVALSHA {evalsha / elapsed:.0f}/s,"
            f" threads {len(_renewer_threads())}"
        )
        # every lock renewed about once per interval, never more than 10 % early
        per_lock = LOCKS * elapsed / INTERVAL
        assert 0.8 * per_lock - LOCKS <= sent <= per_lock / (1 - COALESCE_FRACTION) + LOCKS
        # the renewer sends one EVALSHA per renewal and nothing else (a connection it opened
        # meanwhile says hello first); the count is the server's, the window the renewer's
        # own counter (a batch at either edge may fall on one side only: at most every lock)
        assert set(by_command) <= {c.encode() for c in _SETUP}, by_command
        assert sent - LOCKS <= evalsha <= sent + LOCKS
        assert evalsha / elapsed <= LOCKS / (INTERVAL * (1 - COALESCE_FRACTION)) + LOCKS / hold
        # round trips do not grow with the number of locks: at most one per coalescing window
        assert batches <= elapsed / (INTERVAL * COALESCE_FRACTION) + 2
        for lock in locks:
            assert lock.held
        pttls = redis_client.pipeline(transaction=False)
        for lock in locks:
            pttls.pttl(lock.key)
        assert min(pttls.execute()) > TTL_MS - 2 * INTERVAL * 1000  # renewed, never near expiry
        assert lost == {}

        # one key gone, one stolen: noticed within an interval, and only those two
        redis_client.delete(locks[7].key)
        redis_client.set(locks[8].key, "someone-else", px=60_000)
        wait_until(lambda: len(lost) == 2, INTERVAL + 1.0, "the two losses")
        assert lost == {"acct-00007": "expired", "acct-00008": "stolen"}
        assert redis_client.get(locks[8].key) == b"someone-else"  # not extended
        assert len(renewer) == LOCKS - 2

        # releases stop renewal at once; what is still held goes on being renewed
        for lock in locks[: LOCKS // 2]:
            lock.release()
        assert len(renewer) == LOCKS // 2
        time.sleep(1.5 * INTERVAL)
        for lock in locks[LOCKS // 2 :]:
            lock.ensure_held()
        for lock in locks[LOCKS // 2 :]:
            assert lock.release()
        time.sleep(0.2)  # a batch that was in flight during the last releases has returned
        sent = renewer.renewals
        mon = _Monitor(pw_env.redis_url)
        monitors.append(mon)
        mon.start()
        assert mon.listening.wait(10)
        time.sleep(1.5 * INTERVAL)
        mon.stop(redis_client)
        # nothing held: nothing sent, by the renewer's count and by the server's
        assert renewer.renewals == sent
        assert _renewer_commands(mon, redis_client) == {}
        assert redis_client.dbsize() == 1  # only the stolen key is left (not ours)
    finally:
        for m in monitors:  # a failure midway must not leave the server streaming to one
            if m.is_alive():
                m.stop(redis_client)
        renewer.close()
        for lock in locks:
            lock._token = None  # nothing to release after a failure: the keys expire
