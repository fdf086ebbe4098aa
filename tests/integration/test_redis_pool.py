"""The per-thread Redis pool (payment_worker.redis_pool) against a real Redis: each thread
uses connections of its own, released to their own pool; disconnect reaches them all; a
reset (a forked child) forgets them."""

from __future__ import annotations

import threading

import pytest
import redis

from payment_worker.redis_pool import ThreadLocalConnectionPool, thread_local_client
from tests.conftest import PwEnv, wait_until


def _client_ids(admin: redis.Redis, name: str) -> set[int]:
    return {int(c["id"]) for c in admin.client_list() if c.get("name") == name}


def test_each_thread_has_its_own_connections_and_disconnect_reaches_all(pw_env: PwEnv) -> None:
    client = thread_local_client(pw_env.redis_url, client_name="pw-pool-test")
    pool = client.connection_pool
    assert isinstance(pool, ThreadLocalConnectionPool)
    admin = redis.Redis.from_url(pw_env.redis_url)
    seen: dict[str, int] = {}
    start, worked, done = threading.Barrier(8), threading.Barrier(9), threading.Event()

    def work(n: int) -> None:
        start.wait()
        for i in range(50):
            client.set(f"pw-pool-test:{n}:{i}", i)
            with client.pipeline(transaction=False) as pipe:
                pipe.get(f"pw-pool-test:{n}:{i}")
                pipe.incr("pw-pool-test:count")
                pipe.execute()
        seen[threading.current_thread().name] = int(client.client_id())
        worked.wait()
        done.wait(30)  # alive (its pool with it) until the main thread has disconnected

    threads = [threading.Thread(target=work, args=(n,), name=f"t{n}") for n in range(8)]
    for t in threads:
        t.start()
    worked.wait()
    try:
        assert int(client.get("pw-pool-test:count") or 0) == 400
        # one connection per thread, each thread on its own (and one for this thread)
        assert len(set(seen.values())) == 8
        assert set(seen.values()) <= _client_ids(admin, "pw-pool-test")
        # the threads are alive: disconnect reaches their pools
        pool.disconnect()
        wait_until(lambda: not _client_ids(admin, "pw-pool-test"), 5, "every connection closed")
    finally:
        done.set()
        for t in threads:
            t.join()
    # usable again afterwards (connections reconnect)
    assert client.ping()
    client.close()


def test_a_reset_forgets_the_threads_pools(pw_env: PwEnv) -> None:
    client = thread_local_client(pw_env.redis_url)
    assert client.ping()
    before = client.connection_pool._sub()  # type: ignore[attr-defined]
    client.connection_pool.reset()
    assert client.connection_pool._sub() is not before  # type: ignore[attr-defined]
    assert client.ping()
    client.close()


@pytest.mark.parametrize("kwargs", [{}, {"socket_timeout": 1.0, "health_check_interval": 10}])
def test_the_threads_pools_are_built_like_redis_py_builds_it(
    pw_env: PwEnv, kwargs: dict[str, float]
) -> None:
    client = thread_local_client(pw_env.redis_url, **kwargs)
    plain = redis.Redis.from_url(pw_env.redis_url, **kwargs)
    sub = client.connection_pool._sub()  # type: ignore[attr-defined]
    mine = {k: v for k, v in sub.connection_kwargs.items() if k != "himport_registry"}
    theirs = {
        k: v for k, v in plain.connection_pool.connection_kwargs.items() if k != "himport_registry"
    }
    assert mine.keys() == theirs.keys()
    for key in ("host", "port", "db", "socket_timeout", "health_check_interval"):
        assert mine.get(key) == theirs.get(key)
    client.close()
    plain.close()


def test_more_threads_in_redis_at_once_than_a_plain_pool_allows(pw_env: PwEnv) -> None:
    """redis-py 8 caps a plain pool at 100 connections and raises MaxConnectionsError past
    it: with hundreds of task threads, scenario 5 of issue 13 saw pacing, lock releases and
    whole tasks fail with it. Each thread's own pool never runs out."""
    plain = redis.Redis.from_url(pw_env.redis_url)
    assert plain.connection_pool.max_connections <= 150  # the cap this test goes past
    client = thread_local_client(pw_env.redis_url)
    errors: list[BaseException] = []
    start = threading.Barrier(150)

    def hold_a_connection() -> None:
        start.wait()
        try:
            client.blpop(["pw-pool-test:never"], timeout=1)  # each holds one for a second
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hold_a_connection) for _ in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    client.close()
    plain.close()
