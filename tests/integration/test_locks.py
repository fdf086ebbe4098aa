"""The account lock against real Redis and Postgres, in one process (threads)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import redis
from prometheus_client import REGISTRY
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine

from payment_worker.db.engine import make_engine
from payment_worker.errors import LockLost, LockNotAcquired
from payment_worker.locks.account_lock import AccountLock, lock_is_held, lock_key
from payment_worker.locks.watchdog import Lease, Renewer, renewal_client
from payment_worker.redis_keys import RedisKeys
from tests.conftest import PwEnv, wait_until
from tests.lock_helpers import TcpProxy

ACCOUNT = "acct-7"
KEYS = RedisKeys("pw")


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def engine(pw_env: PwEnv) -> Iterator[Engine]:
    eng = make_engine(pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    yield eng
    eng.dispose()


def make_lock(r: redis.Redis, engine: Engine, ttl_ms: int = 600, **kw: object) -> AccountLock:
    return AccountLock(r, ACCOUNT, engine=engine, ttl_ms=ttl_ms, safety_margin_ms=100, **kw)  # type: ignore[arg-type]


def test_key_has_the_account_hash_tag() -> None:
    assert lock_key("acct-1", "pw") == "pw:lock:{acct-1}"


def test_acquire_fence_release(redis_client: redis.Redis, engine: Engine) -> None:
    a = make_lock(redis_client, engine)
    assert a.key == "pw:lock:{acct-7}"
    assert a.acquire()
    assert a.fence_token == 1
    assert lock_is_held(redis_client, ACCOUNT)
    a.ensure_held()
    assert a.held and not a.lost
    assert 0 < redis_client.pttl(a.key) <= 600
    assert a.release()
    assert not lock_is_held(redis_client, ACCOUNT)
    with pytest.raises(LockLost):
        a.ensure_held()
    # the same object can take it again, with a newer token
    assert a.acquire()
    assert a.fence_token == 2
    a.release()


def test_second_owner_is_refused_and_counted(redis_client: redis.Redis, engine: Engine) -> None:
    a, b = make_lock(redis_client, engine), make_lock(redis_client, engine)
    assert a.acquire()
    before = metric("payment_worker_lock_contention_total")
    assert not b.acquire()
    assert not b.acquire(blocking=True, timeout=0)
    assert metric("payment_worker_lock_contention_total") == before + 2
    assert b.fence_token is None
    a.release()
    assert b.acquire()
    assert b.fence_token == 2
    b.release()


def test_release_of_a_lock_we_no_longer_own_deletes_nothing(
    redis_client: redis.Redis, engine: Engine
) -> None:
    a = make_lock(redis_client, engine, ttl_ms=300)
    assert a.acquire()
    a._renewer.remove(a._lease)  # type: ignore[arg-type]  # let it expire, as after a long pause
    time.sleep(0.4)
    b = make_lock(redis_client, engine, ttl_ms=5000)
    assert b.acquire()
    before = metric("payment_worker_lock_release_not_owner_total")
    assert not a.release()
    assert metric("payment_worker_lock_release_not_owner_total") == before + 1
    assert redis_client.get(b.key) is not None
    b.ensure_held()
    assert b.release()


def test_release_stops_the_renewal_at_once(redis_client: redis.Redis, engine: Engine) -> None:
    # a lock with its own renewer (built without the Runtime's): its thread ends with the release
    a = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=30_000)  # a tick every 10 s
    assert a.acquire()
    lease, thread = a._lease, a._renewer.thread
    assert lease is not None and a._renewer.holds(lease)
    assert thread is not None and thread.is_alive()
    t0 = time.monotonic()
    assert a.release()
    released_in = time.monotonic() - t0
    assert not a._renewer.holds(lease)  # never renewed again, from the moment release returns
    thread.join(1.0)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 1.0
    assert released_in < 0.1


def test_release_stops_the_renewal_of_a_shared_renewer(
    redis_client: redis.Redis, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    ttl_ms = 1500  # a renewal every 0.5 s
    renewer = Renewer(renewal_client(redis_client, ttl_ms))
    # every batch sent: the number of the tick that built it, and the keys it renews. A
    # batch of a tick that began before a release returned may still carry the released
    # lock (built just before); one of a later tick must not
    ticks: list[int] = []
    batches: list[tuple[int, list[str]]] = []
    real_tick, real_renew_many = renewer.tick, renewer.renew_many

    def tick() -> float | None:
        ticks.append(len(ticks) + 1)
        return real_tick()

    def renew_many(batch: list[Lease]) -> list[object]:
        batches.append((len(ticks), [lease.key for lease in batch]))
        return real_renew_many(batch)

    monkeypatch.setattr(renewer, "tick", tick)
    monkeypatch.setattr(renewer, "renew_many", renew_many)

    def sent_after(tick_no: int, key: str) -> int:
        return sum(1 for t, keys in batches if t > tick_no and key in keys)

    a = make_lock(redis_client, engine, ttl_ms=ttl_ms, renewer=renewer)
    other = AccountLock(
        redis_client, "acct-8", engine=engine, ttl_ms=ttl_ms, safety_margin_ms=100, renewer=renewer
    )
    try:
        assert a.acquire() and other.acquire()
        wait_until(lambda: sent_after(0, a.key) >= 1, 10, "a renewal of the lock")
        assert a.release()
        released_in = len(ticks)
        # three renewals of the other lock since: the released one is in none of them
        wait_until(lambda: sent_after(released_in, other.key) >= 3, 10, "three more renewals")
        assert sent_after(released_in, a.key) == 0, batches
        assert not lock_is_held(redis_client, ACCOUNT)
        other.ensure_held()
        assert redis_client.pttl(other.key) > 0
        assert other.release()
        released_in = len(ticks)
        time.sleep(2 * ttl_ms / 3000)  # two intervals
        assert [b for b in batches if b[0] > released_in] == []  # nothing held: nothing sent
    finally:
        renewer.close()


# a 600 ms TTL is trusted for 500 ms after each renewal: a renewer thread kept off the CPU by
# other tests for 300 ms would fail it, so it runs alone
@pytest.mark.exclusive
def test_renewal_keeps_the_lock_for_ten_ttls(redis_client: redis.Redis, engine: Engine) -> None:
    # 600 ms: a renewal every 200 ms, so a loaded 2-core machine's pause of a few hundred ms
    # is survived (at 300 ms one serial run lost the lock to its local deadline)
    ttl_ms = 600
    a = make_lock(redis_client, engine, ttl_ms=ttl_ms)
    rival = make_lock(redis_client, engine, ttl_ms=ttl_ms)
    ok_before = metric("payment_worker_lock_renewals_total", result="ok")
    assert a.acquire()
    end = time.monotonic() + 10 * ttl_ms / 1000
    checks = 0
    while time.monotonic() < end:
        a.ensure_held()  # the holder "works" and checks before every side effect
        assert redis_client.get(a.key) is not None
        if checks % 10 == 0:
            assert not rival.acquire()
        checks += 1
        time.sleep(0.02)
    a.ensure_held()
    renewals = metric("payment_worker_lock_renewals_total", result="ok") - ok_before
    # at TTL/3 over 10 TTLs: about 30 renewals
    assert renewals >= 25
    assert a.release()


def test_deleted_key_is_noticed_within_a_third_of_the_ttl(
    redis_client: redis.Redis, engine: Engine
) -> None:
    ttl_ms = 600
    lost = threading.Event()
    reasons: list[str] = []
    renewer = Renewer(renewal_client(redis_client, ttl_ms), linger=0.0)
    a = make_lock(
        redis_client,
        engine,
        ttl_ms=ttl_ms,
        renewer=renewer,
        on_lost=lambda r: (reasons.append(r), lost.set()),
    )
    before = metric("payment_worker_lock_lost_total", reason="expired")
    try:
        assert a.acquire()
        time.sleep(0.05)
        _noticed_by_the_next_renewal(renewer, lost, ttl_ms, lambda: redis_client.delete(a.key))
    finally:
        renewer.close()  # its thread stops whatever failed above
    assert reasons == ["expired"]
    assert a.lost and a.lost_reason == "expired"
    assert metric("payment_worker_lock_lost_total", reason="expired") == before + 1
    with pytest.raises(LockLost):
        a.ensure_held()
    assert not a.release()  # nothing of ours left to delete


def _noticed_by_the_next_renewal(
    renewer: Renewer, lost: threading.Event, ttl_ms: int, fault: Callable[[], object]
) -> None:
    """``fault`` takes the lock's key away: the first renewal after it finds the lock lost (a
    second only if the first was in flight and ran before the fault). Counted, not timed, so
    that a loaded host's scheduling delay decides nothing; and before the lease would have run
    out anyway."""
    fault()
    batches, t0 = renewer.batches, time.monotonic()
    assert lost.wait(5)
    noticed = time.monotonic() - t0
    assert renewer.batches - batches <= 2, renewer.batches - batches
    assert noticed < ttl_ms / 1000, noticed


def test_stolen_key_is_noticed_and_not_extended(redis_client: redis.Redis, engine: Engine) -> None:
    a = make_lock(redis_client, engine, ttl_ms=600)
    lost = threading.Event()
    a._on_lost = lambda _r: lost.set()
    assert a.acquire()
    redis_client.set(a.key, "someone-else", px=5000)
    assert lost.wait(1)
    assert a.lost_reason == "stolen"
    assert redis_client.pttl(a.key) > 4000  # the renewal did not touch the other's lock
    assert not a.release()
    assert redis_client.get(a.key) == b"someone-else"


def test_redis_flushed_and_connections_killed_is_noticed(
    pw_env: PwEnv, redis_client: redis.Redis, engine: Engine
) -> None:
    """What a Redis restart without persistence looks like: data gone, connections dropped."""
    holder = redis.Redis.from_url(pw_env.redis_url)
    holder.client_setname("lock-holder")
    lost = threading.Event()
    ttl_ms = 1500
    # the renewer a lock builds for itself, made here to count its renewals
    renewer = Renewer(renewal_client(holder, ttl_ms), linger=0.0)
    a = make_lock(holder, engine, ttl_ms=ttl_ms, renewer=renewer, on_lost=lambda _r: lost.set())
    try:
        assert a.acquire()

        def restart() -> None:
            redis_client.flushdb()
            for client in redis_client.client_list():
                if client.get("name") == "lock-holder":
                    redis_client.client_kill_filter(_id=client["id"])

        _noticed_by_the_next_renewal(renewer, lost, ttl_ms, restart)
    finally:
        renewer.close()
    assert a.lost_reason == "expired"


def test_unreachable_redis_marks_the_lock_lost_at_the_local_deadline(
    pw_env: PwEnv, engine: Engine
) -> None:
    url = urlsplit(pw_env.redis_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 6379)
    db = int(url.path.strip("/") or 0)
    holder = redis.Redis(
        port=proxy.port,
        db=db,
        socket_timeout=0.1,
        socket_connect_timeout=0.1,
        retry=Retry(NoBackoff(), 0),  # so that the final release fails fast
    )
    lost = threading.Event()
    ttl_ms, margin_ms = 600, 100
    a = AccountLock(
        holder,
        ACCOUNT,
        engine=engine,
        ttl_ms=ttl_ms,
        safety_margin_ms=margin_ms,
        on_lost=lambda _r: lost.set(),
    )
    errors_before = metric("payment_worker_lock_renewals_total", result="error")
    before = time.monotonic()
    assert a.acquire()
    after = time.monotonic()
    proxy.cut()
    assert lost.wait(3)
    lost_at = time.monotonic()
    assert a.lost_reason == "unreachable"
    assert metric("payment_worker_lock_renewals_total", result="error") > errors_before
    # never before the local deadline (counted from before the grant was sent), and no
    # later than the deadline plus one retry step
    deadline = (ttl_ms - margin_ms) / 1000
    assert lost_at - before >= deadline - 0.01, lost_at - before
    assert lost_at - after <= deadline + ttl_ms / 3000, lost_at - after
    with pytest.raises(LockLost):
        a.ensure_held()
    assert not a.release()  # Redis unreachable: nothing released, the TTL frees it


def test_ensure_held_checks_the_deadline_without_the_watchdog(
    redis_client: redis.Redis, engine: Engine
) -> None:
    a = make_lock(redis_client, engine, ttl_ms=300)
    assert a.acquire()
    a._renewer.remove(a._lease)  # type: ignore[arg-type]  # as if the process had been paused
    time.sleep(0.25)  # past TTL - margin, before the key expires
    with pytest.raises(LockLost):
        a.ensure_held()
    assert a.lost_reason == "deadline"


def test_fence_failure_releases_the_redis_lock(redis_client: redis.Redis) -> None:
    bad = make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    a = make_lock(redis_client, bad)
    with pytest.raises(Exception, match="connect"):
        a.acquire()
    assert not lock_is_held(redis_client, ACCOUNT)
    with pytest.raises(LockLost):
        a.ensure_held()


def test_context_manager(redis_client: redis.Redis, engine: Engine) -> None:
    with make_lock(redis_client, engine) as a:
        a.ensure_held()
        # LOCK_WAIT_TIMEOUT defaults to 0: no wait
        with pytest.raises(LockNotAcquired), make_lock(redis_client, engine):
            pass
    assert not lock_is_held(redis_client, ACCOUNT)


def test_blocking_acquire_wakes_on_release_not_on_a_timer(
    redis_client: redis.Redis, engine: Engine
) -> None:
    # with a 30 s TTL the fallback check runs every 10 s: a quick wake can only be the push
    a = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=30_000)
    b = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=30_000)
    assert a.acquire()
    got: dict[str, float] = {}

    def wait() -> None:
        if b.acquire(blocking=True, timeout=20):
            got["at"] = time.monotonic()

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    released = time.monotonic()
    assert a.release()
    t.join(5)
    # the push, not the fallback check 10 s after the wait began
    assert got["at"] - released < 2.0
    assert b.fence_token == 2
    b.ensure_held()
    b.release()
    assert redis_client.keys("*") == []  # queue, leases and wake lists cleaned up


def test_blocking_acquire_times_out_and_leaves_the_queue(
    redis_client: redis.Redis, engine: Engine
) -> None:
    a, b = make_lock(redis_client, engine), make_lock(redis_client, engine)
    assert a.acquire()
    t0 = time.monotonic()
    assert not b.acquire(blocking=True, timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 1.0
    assert redis_client.llen(KEYS.lock_queue(ACCOUNT)) == 0
    assert redis_client.hlen(KEYS.lock_waiters(ACCOUNT)) == 0
    assert a.release()
    assert not lock_is_held(redis_client, ACCOUNT)  # nothing was handed to the leaver


def test_waiters_are_served_in_arrival_order(redis_client: redis.Redis, engine: Engine) -> None:
    holder = make_lock(redis_client, engine)
    assert holder.acquire()
    order: list[int] = []
    threads = []
    for i in range(5):
        lock = make_lock(redis_client, engine)

        def run(lock: AccountLock = lock, i: int = i) -> None:
            assert lock.acquire(blocking=True, timeout=10)
            order.append(i)
            time.sleep(0.01)
            lock.release()

        t = threading.Thread(target=run)
        t.start()
        threads.append(t)
        # each one is queued before the next arrives
        while redis_client.llen(KEYS.lock_queue(ACCOUNT)) < i + 1:
            time.sleep(0.005)
    holder.release()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3, 4]


def test_a_fence_on_a_connection_that_died_is_retried_and_counted(
    pw_env: PwEnv, redis_client: redis.Redis
) -> None:
    """A Postgres restart met first by a fencing upsert is retried at once on a fresh
    connection, and counted with the drain's database retries: the pool replaces its other
    dead connections after this one, so nothing else would show the restart."""
    import psycopg

    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    eng = make_engine(url, pool_size=1, application_name="pw-fence-test")
    try:
        warm = make_lock(redis_client, eng)
        assert warm.acquire()  # the pool now holds one connection
        warm.release()
        with psycopg.connect(pw_env.database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'pw-fence-test'"
            )
        before = sum(
            metric("payment_worker_db_retries_total", reason=r)
            for r in ("admin_shutdown", "disconnect", "connection")
        )
        lock = make_lock(redis_client, eng)
        assert lock.acquire()
        assert lock.fence_token is not None and lock.fence_token > 1
        lock.release()
        after = sum(
            metric("payment_worker_db_retries_total", reason=r)
            for r in ("admin_shutdown", "disconnect", "connection")
        )
        assert after == before + 1
    finally:
        eng.dispose()


def test_the_runtimes_lock_waits_for_lock_wait_timeout(
    pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``with runtime.account_lock(a):`` waits up to LOCK_WAIT_TIMEOUT for a busy lock (the
    setting was once accepted and never read: the lock never waited)."""
    from payment_worker import runtime

    monkeypatch.setenv("LOCK_WAIT_TIMEOUT", "20")
    runtime.reset()
    rt = runtime.current()
    holder = rt.account_lock(ACCOUNT)
    assert holder.acquire()
    released = threading.Event()

    def release_soon() -> None:
        time.sleep(0.3)
        released.set()
        holder.release()

    threading.Thread(target=release_soon, daemon=True).start()
    with rt.account_lock(ACCOUNT) as waiter:
        assert released.is_set()
        waiter.ensure_held()
    assert not lock_is_held(rt.redis, ACCOUNT, rt.settings.redis_key_prefix)
