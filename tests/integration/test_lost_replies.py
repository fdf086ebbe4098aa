"""Lost replies and unreachable Redis at the lock's take and release.

The runtime's clients make no retries by default (redis-py 8 builds a connection from a
pool's URL without any), so a take or a release whose round trip fails raises or reports
failure, and its lock, which may have been taken or not released, is given back by the
process's give-back thread (``payment_worker.locks.giveback``) once Redis answers: a holder
that does not know it holds a lock never keeps it for the TTL (30 s).

A client that does retry (``REDIS_URL`` with ``retry_on_timeout=true``) runs a take whose
reply was lost again: the retry finds the lock holding its own value, unique to one
acquisition, so the lock is the retry's: taken (``lib/lock_take.lua``, a dead holder's lock
replaced by ``lock_takeover.lua``), and the refresh lock its start took is its own too
(``lib/token_claim.lua``). Before, the retry answered "busy", and the account stayed locked
by a holder that did not know it until the lock's TTL ran out.

The faults are real: a TCP proxy in front of Redis throws a reply away, or closes every
connection and refuses new ones (tests/lock_helpers.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from payment_worker import runtime
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.giveback import FIRST_DELAY, GiveBack
from payment_worker.locks.liveness import TAKEOVER_LUA, holder_of, lock_value, take_over
from payment_worker.worker.queueing import RedisAccountQueue
from tests.conftest import PwEnv
from tests.lock_helpers import TcpProxy, proxied_redis

pytestmark = pytest.mark.integration

ACCT = "acct-lost-reply"


@pytest.fixture
def proxied(
    pw_env: PwEnv, rt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TcpProxy, AccountLock]]:
    """The runtime's own lock of ``ACCT``, built on a client behind the reply-losing proxy
    that retries a failed command once."""
    with proxied_redis(pw_env.redis_url) as (proxy, client):
        monkeypatch.setattr(rt, "redis", client)
        yield proxy, rt.account_lock(ACCT)


@pytest.fixture
def unretried(
    pw_env: PwEnv, rt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TcpProxy, AccountLock, GiveBack]]:
    """The same on a client without retries (the runtime's default), with a give-back the
    test drives by hand."""
    giveback = GiveBack(threaded=False)
    with proxied_redis(pw_env.redis_url, retries=0) as (proxy, client):
        monkeypatch.setattr(rt, "redis", client)
        monkeypatch.setattr(rt, "giveback", giveback)
        yield proxy, rt.account_lock(ACCT), giveback


def _released_while_cut(rt: runtime.Runtime, proxy: TcpProxy, lock: AccountLock) -> None:
    """The lock taken, then Redis cut away: the release is refused (reported False) and
    handed to the give-back."""
    rt.liveness.start()
    assert lock.acquire(fence=False)
    proxy.cut()
    assert not lock.release()


def _run_give_back(giveback: GiveBack) -> None:
    """One pass of the give-back thread, once its first pause is over."""
    time.sleep(FIRST_DELAY * 1.5)
    giveback.run_due()


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
        released = lock.release()  # (asserted after: a failure above is not hidden)
    assert released
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
        released = lock.release(queue.arrival(ACCT, "b-1"), end)
    assert released
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


def test_a_take_whose_reply_is_lost_is_given_back(
    rt: runtime.Runtime,
    redis_client: redis.Redis,
    unretried: tuple[TcpProxy, AccountLock, GiveBack],
) -> None:
    """No retry: the acquire raises, though the take ran and the lock holds its value; the
    give-back frees it (before, it stayed for the TTL, its holder alive, so no taker could
    take it over)."""
    proxy, lock, giveback = unretried
    rt.liveness.start()
    proxy.drop_next_reply.set()
    with pytest.raises(redis.exceptions.TimeoutError):
        lock.acquire(fence=False)
    assert not proxy.drop_next_reply.is_set()  # the reply was lost
    assert not lock.held
    value = redis_client.get(rt.keys.lock(ACCT))
    assert holder_of(value) == rt.liveness.holder_id  # the take ran
    assert len(giveback) == 1
    _run_give_back(giveback)
    assert len(giveback) == 0
    assert not redis_client.exists(rt.keys.lock(ACCT))


def test_a_release_that_cannot_reach_redis_is_given_back_once_it_answers(
    rt: runtime.Runtime,
    redis_client: redis.Redis,
    unretried: tuple[TcpProxy, AccountLock, GiveBack],
) -> None:
    proxy, lock, giveback = unretried
    _released_while_cut(rt, proxy, lock)
    assert redis_client.exists(rt.keys.lock(ACCT))
    assert len(giveback) == 1
    _run_give_back(giveback)  # still refused: tried again later
    assert len(giveback) == 1
    assert redis_client.exists(rt.keys.lock(ACCT))
    proxy.reopen()
    time.sleep(FIRST_DELAY * 2)  # the pause doubled after the failed try
    _run_give_back(giveback)
    assert len(giveback) == 0
    assert not redis_client.exists(rt.keys.lock(ACCT))


def test_a_give_back_never_touches_a_lock_that_is_no_longer_ours(
    rt: runtime.Runtime,
    redis_client: redis.Redis,
    unretried: tuple[TcpProxy, AccountLock, GiveBack],
) -> None:
    """The lock expired during the outage and another holder took it: the give-back finds
    another value and leaves it."""
    proxy, lock, giveback = unretried
    _released_while_cut(rt, proxy, lock)
    other = lock_value("other-7-live0001", "e" * 32)
    redis_client.set(rt.keys.lock(ACCT), other, px=30_000)
    proxy.reopen()
    time.sleep(FIRST_DELAY)
    _run_give_back(giveback)
    assert len(giveback) == 0
    assert redis_client.get(rt.keys.lock(ACCT)) == other.encode()


def test_a_sweepers_takeover_retried_after_its_lost_reply_frees_the_account(
    rt: runtime.Runtime,
    redis_client: redis.Redis,
    proxied: tuple[TcpProxy, AccountLock],
) -> None:
    """The sweeper deletes a dead holder's lock (``lock_takeover.lua`` with no new value) and
    the reply is lost: the retry finds no lock, which is what it asked for, and answers done.
    Before, it answered "changed meanwhile": the sweeper counted the account busy and left it
    until its next stale period."""
    proxy, _ = proxied
    key = rt.keys.lock(ACCT)
    dead = lock_value("ghost-41-dead0001", "f" * 32)
    redis_client.set(key, dead, px=30_000)
    rt.redis.script_load(TAKEOVER_LUA)  # the reply lost is of a run, not of a NOSCRIPT
    proxy.drop_next_reply.set()
    assert take_over(rt.redis, key, dead)
    assert not proxy.drop_next_reply.is_set()  # a reply was lost
    assert not redis_client.exists(key)
    # another value is still never touched
    other = lock_value("live-7-live0001", "e" * 32)
    redis_client.set(key, other, px=30_000)
    assert not take_over(rt.redis, key, dead)
    assert redis_client.get(key) == other.encode()
