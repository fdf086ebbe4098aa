"""A lock take whose reply is lost, and the client's retry (redis-py retries a command on a
connection error or a timeout; the runtime's client keeps redis-py's default retries).

The take ran; the retry runs it again and finds the lock holding its own value. That value
is unique to one acquisition, so the lock is the retry's: taken (``lib/lock_take.lua``, a
dead holder's lock replaced by ``lock_takeover.lua``), and the refresh lock its start took
is its own too (``lib/token_claim.lua``). Before, the retry answered "busy", and the account
stayed locked by a holder that did not know it until the lock's TTL (30 s) ran out.

The fault is real: a TCP proxy in front of Redis throws the reply away
(tests/lock_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from payment_worker import runtime
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.liveness import TAKEOVER_LUA, holder_of, lock_value
from payment_worker.worker.queueing import RedisAccountQueue
from tests.conftest import PwEnv
from tests.lock_helpers import TcpProxy, proxied_redis

pytestmark = pytest.mark.integration

ACCT = "acct-lost-reply"


@pytest.fixture
def proxied(
    pw_env: PwEnv, rt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TcpProxy, AccountLock]]:
    """The runtime's own lock of ``ACCT``, built on a client behind the reply-losing proxy."""
    with proxied_redis(pw_env.redis_url) as (proxy, client):
        monkeypatch.setattr(rt, "redis", client)
        yield proxy, rt.account_lock(ACCT)


def _warm(rt: runtime.Runtime, queue: RedisAccountQueue) -> None:
    """The start and end scripts loaded into Redis, so the reply lost is one that ran (not a
    ``NOSCRIPT`` that redis-py answers by loading the script)."""
    lock = rt.account_lock("acct-warm")
    assert lock.acquire(
        arrival=queue.arrival("acct-warm", "b-0"), rider=rt.gateway.account_start("acct-warm")
    )
    assert lock.release(queue.arrival("acct-warm", "b-0"), rt.gateway.account_end("acct-warm"))


def _taken_after_a_lost_reply(
    rt: runtime.Runtime, lock: AccountLock, proxy: TcpProxy, redis_client: redis.Redis
) -> None:
    """A plain acquire whose granting command's reply the proxy throws away: the lock is
    ours all the same, and goes back on release."""
    try:
        assert lock.acquire(fence=False)
        assert not proxy.drop_next_reply.is_set()  # a reply was lost
        assert holder_of(redis_client.get(rt.keys.lock(ACCT))) == rt.liveness.holder_id
        lock.ensure_held()
    finally:
        assert lock.release()
    assert not redis_client.exists(rt.keys.lock(ACCT))


def test_a_takes_retry_after_its_lost_reply_holds_the_lock(
    rt: runtime.Runtime,
    redis_client: redis.Redis,
    proxied: tuple[TcpProxy, AccountLock],
) -> None:
    proxy, lock = proxied
    queue = RedisAccountQueue(rt)
    _warm(rt, queue)
    rider = rt.gateway.account_start(ACCT)  # no token yet: the start takes the refresh lock
    assert rider is not None
    proxy.drop_next_reply.set()
    try:
        assert lock.acquire(arrival=queue.arrival(ACCT, "b-1"), fence=False, rider=rider)
        assert not proxy.drop_next_reply.is_set()  # a reply was lost
        value = redis_client.get(rt.keys.lock(ACCT))
        assert holder_of(value) == rt.liveness.holder_id
        assert not redis_client.exists(rt.keys.waiting(ACCT))  # no "busy" mark left
        lock.ensure_held()
        # the refresh lock the first run took is the retry's: its owner is the rider's
        owner = redis_client.get(rt.keys.token_lock(ACCT))
        assert owner is not None and owner.decode() == rider.args[0]
    finally:
        end = rt.gateway.account_end(ACCT)
        assert lock.release(queue.arrival(ACCT, "b-1"), end)
    assert not redis_client.exists(rt.keys.lock(ACCT))
    assert not redis_client.exists(rt.keys.token_lock(ACCT))


def test_a_plain_takes_retry_after_its_lost_reply_holds_the_lock(
    rt: runtime.Runtime,
    redis_client: redis.Redis,
    proxied: tuple[TcpProxy, AccountLock],
) -> None:
    proxy, lock = proxied
    rt.liveness.start()
    proxy.drop_next_reply.set()
    _taken_after_a_lost_reply(rt, lock, proxy, redis_client)


def test_a_takeovers_retry_after_its_lost_reply_holds_the_lock(
    rt: runtime.Runtime,
    redis_client: redis.Redis,
    proxied: tuple[TcpProxy, AccountLock],
) -> None:
    """A dead holder's lock replaced by ``lock_takeover.lua``, whose reply is lost: the
    retry finds the lock holding the taker's own value and answers "taken"."""
    proxy, lock = proxied
    redis_client.set(rt.keys.lock(ACCT), lock_value("ghost-41-dead0001", "f" * 32), px=30_000)
    rt.redis.script_load(TAKEOVER_LUA)  # the reply lost is of a run, not of a NOSCRIPT
    rt.liveness.start()
    takeover = lock._takeover

    def reply_lost(**kw: Any) -> Any:
        proxy.drop_next_reply.set()
        return takeover(**kw)

    lock._takeover = reply_lost  # type: ignore[method-assign]
    _taken_after_a_lost_reply(rt, lock, proxy, redis_client)
