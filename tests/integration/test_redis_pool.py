"""The sharded Redis pool (payment_worker.redis_pool) against a real Redis: threads are dealt
over the sub-pools and share their connections, so a stream of new threads opens no
connection per thread; a connection goes back to its own sub-pool; disconnect reaches them
all; a reset (a forked child) forgets them."""

from __future__ import annotations

import threading

import pytest
import redis
import redis.utils

from payment_worker.redis_pool import SHARDS, ShardedConnectionPool, driver_info, sharded_client
from tests.conftest import PwEnv, wait_until


def _client_ids(admin: redis.Redis, name: str) -> set[int]:
    return {int(c["id"]) for c in admin.client_list() if c.get("name") == name}


def _run_in_thread(fn: object) -> None:
    t = threading.Thread(target=fn)  # type: ignore[arg-type]
    t.start()
    t.join()


def test_new_threads_reuse_the_connections_of_threads_before_them(pw_env: PwEnv) -> None:
    """Celery's threads pool starts a thread for each task that finds none idle: a pool per
    thread opened a connection for each (six round trips, about 1.5 ms of CPU)."""
    client = sharded_client(pw_env.redis_url, client_name="pw-pool-reuse", shards=4)
    admin = redis.Redis.from_url(pw_env.redis_url)
    ids: list[int] = []
    try:
        for _ in range(40):  # one after another, each a new thread
            _run_in_thread(lambda: ids.append(int(client.client_id())))
        # at most one connection per sub-pool, not one per thread
        assert len(set(ids)) <= 4
        assert len(_client_ids(admin, "pw-pool-reuse")) <= 4
    finally:
        client.close()
        admin.close()


def test_threads_at_once_share_connections_and_disconnect_reaches_all(pw_env: PwEnv) -> None:
    client = sharded_client(pw_env.redis_url, client_name="pw-pool-test")
    pool = client.connection_pool
    assert isinstance(pool, ShardedConnectionPool)
    admin = redis.Redis.from_url(pw_env.redis_url)
    start, worked, done = threading.Barrier(8), threading.Barrier(9), threading.Event()

    def work(n: int) -> None:
        start.wait()
        for i in range(50):
            client.set(f"pw-pool-test:{n}:{i}", i)
            with client.pipeline(transaction=False) as pipe:
                pipe.get(f"pw-pool-test:{n}:{i}")
                pipe.incr("pw-pool-test:count")
                pipe.execute()
        worked.wait()
        done.wait(30)  # alive until the main thread has disconnected

    threads = [threading.Thread(target=work, args=(n,), name=f"t{n}") for n in range(8)]
    for t in threads:
        t.start()
    worked.wait()
    try:
        assert int(client.get("pw-pool-test:count") or 0) == 400
        # never more connections than threads in Redis at once (8, and this one)
        assert 1 <= len(_client_ids(admin, "pw-pool-test")) <= 9
        pool.disconnect()
        wait_until(lambda: not _client_ids(admin, "pw-pool-test"), 5, "every connection closed")
    finally:
        done.set()
        for t in threads:
            t.join()
    # usable again afterwards (connections reconnect)
    assert client.ping()
    client.close()
    admin.close()


def test_a_connection_goes_back_to_its_own_sub_pool(pw_env: PwEnv) -> None:
    client = sharded_client(pw_env.redis_url, shards=2)
    pool = client.connection_pool
    assert isinstance(pool, ShardedConnectionPool)
    taken: list[object] = []
    _run_in_thread(lambda: taken.append(pool.get_connection()))
    conn = taken[0]
    home = conn._pw_pool  # type: ignore[attr-defined]
    pool.release(conn)  # released by another thread than the one that took it
    assert conn in home._available_connections
    assert all(conn not in p._available_connections for p in pool._shards if p is not home)
    client.close()


def test_a_reset_forgets_the_sub_pools_connections(pw_env: PwEnv) -> None:
    client = sharded_client(pw_env.redis_url)
    assert client.ping()
    sub = client.connection_pool._sub()  # type: ignore[attr-defined]
    assert sub._available_connections
    client.connection_pool.reset()
    assert not sub._available_connections
    assert client.ping()
    client.close()


def test_shards_must_be_positive(pw_env: PwEnv) -> None:
    with pytest.raises(ValueError, match="shards"):
        ShardedConnectionPool.from_url(pw_env.redis_url, shards=0)


@pytest.mark.parametrize("kwargs", [{}, {"socket_timeout": 1.0, "health_check_interval": 10}])
def test_the_sub_pools_are_built_like_redis_py_builds_it(
    pw_env: PwEnv, kwargs: dict[str, float]
) -> None:
    client = sharded_client(pw_env.redis_url, **kwargs)
    plain = redis.Redis.from_url(pw_env.redis_url, **kwargs)
    pool = client.connection_pool
    assert isinstance(pool, ShardedConnectionPool)
    assert len(pool._shards) == SHARDS
    sub = pool._sub()
    skip = {"himport_registry", "driver_info"}
    mine = {k: v for k, v in sub.connection_kwargs.items() if k not in skip}
    theirs = {k: v for k, v in plain.connection_pool.connection_kwargs.items() if k not in skip}
    assert mine.keys() == theirs.keys()
    for key in ("host", "port", "db", "socket_timeout", "health_check_interval"):
        assert mine.get(key) == theirs.get(key)
    client.close()
    plain.close()


def test_the_client_identifies_itself_without_reading_package_metadata_per_connection(
    pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = driver_info()
    if info is None:
        pytest.skip("this redis-py has no DriverInfo")
    client = sharded_client(pw_env.redis_url, client_name="pw-pool-info")
    admin = redis.Redis.from_url(pw_env.redis_url)
    assert admin.ping()  # its connection made before the patch (a plain client reads it)

    def forbidden() -> str:
        raise AssertionError("package metadata read for a connection")

    monkeypatch.setattr(redis.utils, "get_lib_version", forbidden)
    try:
        for _ in range(3):
            _run_in_thread(client.ping)
        mine = [c for c in admin.client_list() if c.get("name") == "pw-pool-info"]
        assert mine
        # Redis 7.2 and later show what CLIENT SETINFO told them (earlier ones refuse it,
        # which redis-py ignores)
        if "lib-name" in mine[0]:
            assert all(c["lib-name"] == info.formatted_name for c in mine)
            assert all(c["lib-ver"] == info.lib_version for c in mine)
    finally:
        client.close()
        admin.close()


def test_more_threads_in_redis_at_once_than_a_plain_pool_allows(pw_env: PwEnv) -> None:
    """redis-py 8 caps a plain pool at 100 connections and raises MaxConnectionsError past
    it: with hundreds of task threads, scenario 5 of issue 13 saw pacing, lock releases and
    whole tasks fail with it. Each sub-pool has that cap, for a few threads each."""
    plain = redis.Redis.from_url(pw_env.redis_url)
    assert plain.connection_pool.max_connections <= 150  # the cap this test goes past
    client = sharded_client(pw_env.redis_url)
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


def test_connections_opened_ahead_serve_the_threads_without_a_connect(pw_env: PwEnv) -> None:
    """A fresh worker opens its connections before its first burst (open_idle): they are
    dealt over the sub-pools, idle, and the burst's threads use them, opening none."""
    client = sharded_client(pw_env.redis_url, client_name="pw-pool-ahead", shards=4)
    admin = redis.Redis.from_url(pw_env.redis_url)
    pool = client.connection_pool
    assert isinstance(pool, ShardedConnectionPool)
    try:
        assert pool.open_idle(10) == 10
        ahead = _client_ids(admin, "pw-pool-ahead")
        assert len(ahead) == 10
        # 3, 3, 2, 2 idle in the four sub-pools, none lent out
        assert sorted(len(p._available_connections) for p in pool._shards) == [2, 2, 3, 3]
        assert all(not p._in_use_connections for p in pool._shards)
        # eight threads at once, two per sub-pool: each finds an idle connection
        gate = threading.Barrier(8)

        def burst() -> None:
            gate.wait()
            client.ping()

        threads = [threading.Thread(target=burst) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert _client_ids(admin, "pw-pool-ahead") == ahead
    finally:
        client.close()
        admin.close()


def test_opening_ahead_against_no_server_raises_and_keeps_nothing(pw_env: PwEnv) -> None:
    pool = ShardedConnectionPool.from_url("redis://127.0.0.1:1/0", shards=2)
    with pytest.raises(redis.ConnectionError):
        pool.open_idle(4)
    assert all(not p._in_use_connections for p in pool._shards)
