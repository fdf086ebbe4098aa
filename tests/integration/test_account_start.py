"""A drain's start in one round trip (lua/account_start.lua): the account lock taken with its
marks, and, only when it is taken, the account's shared token read (the refresh lock taken
when a new token is needed) and a block of pacing slots leased, where the first request used
to spend two round trips of its own. Real Postgres and Redis, the simulator over HTTP."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from payment_worker import lua, runtime
from payment_worker.dev.samples import make_batches
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.arrival import Arrival
from payment_worker.producer.submit import submit_batch
from payment_worker.worker import drain
from payment_worker.worker.queueing import RedisAccountQueue
from tests.conftest import PwEnv, submit_accounts
from tests.sim_fixtures import SimHandle

pytestmark = pytest.mark.integration


@pytest.fixture
def res(pw_env: PwEnv, gateway_sim: SimHandle) -> Iterator[runtime.Runtime]:
    runtime.reset()
    yield runtime.current()
    runtime.reset()


@pytest.fixture
def commands(res: runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The commands the runtime's Redis client sends (each one a round trip), with the
    script's name for EVALSHA."""
    names = {}
    for name in (
        "account_start",
        "lock_take",
        "token_claim",
        "pace_acquire",
        "token_store",
        "account_end",
        "lock_release",
        "token_release",
    ):
        names[res.redis.register_script(lua.load(name)).sha] = name
    sent: list[str] = []
    client = res.redis
    original: Callable[..., Any] = client.execute_command

    def counting(*args: Any, **options: Any) -> Any:
        cmd = str(args[0])
        sent.append(names.get(str(args[1]), cmd) if cmd == "EVALSHA" else cmd)
        return original(*args, **options)

    monkeypatch.setattr(client, "execute_command", counting)
    yield sent


def test_a_fresh_account_starts_in_one_round_trip_and_refreshes_under_its_lock(
    res: runtime.Runtime, gateway_sim: SimHandle, commands: list[str]
) -> None:
    [warm, batch] = submit_accounts(2, 3, "start")
    drain.run_account(warm["account_id"], warm["batch_id"], res)  # scripts loaded once
    commands.clear()
    report = drain.run_account(batch["account_id"], batch["batch_id"], res)
    assert report.result == "processed" and report.items == 3
    scripts = [c for c in commands if c in ("account_start", "lock_take", "token_claim")]
    # the token's read and the lease came with the lock: no token_claim, no pace_acquire
    assert scripts == ["account_start"], commands
    assert "pace_acquire" not in commands and commands.count("token_store") == 1
    ledger = gateway_sim.ledger()
    assert ledger["tokens_issued_per_account"] == {warm["account_id"]: 1, batch["account_id"]: 1}
    assert ledger["http_429_by_cause"]["rate"] == 0
    # and it ends in one round trip too: the lease's unused slots went back with the lock
    assert commands == ["account_start", "token_store", "account_end"], commands
    # the refresh lock taken at the start was released by the token's store
    assert not res.redis.exists(res.gateway.tokens.lock_key(batch["account_id"]))


def test_an_account_whose_token_this_process_knows_reads_only_the_lease(
    res: runtime.Runtime, gateway_sim: SimHandle, commands: list[str]
) -> None:
    [batch] = submit_accounts(1, 2, "known")
    acct = batch["account_id"]
    drain.run_account(acct, batch["batch_id"], res)
    [more] = make_batches(batches=1, items=2, accounts=1, prefix="known2")
    more["account_id"] = acct
    assert submit_batch(more, enqueue=False).status == "accepted"
    assert not res.gateway.pacer._leases  # the first drain's lease went back as it ended
    commands.clear()
    assert drain.run_account(acct, more["batch_id"], res).items == 2
    assert [c for c in commands if c in ("account_start", "token_claim", "pace_acquire")] == [
        "account_start"
    ]
    assert gateway_sim.ledger()["tokens_issued_per_account"] == {acct: 1}


def test_a_busy_lock_reads_nothing_and_takes_no_refresh_lock(
    res: runtime.Runtime, redis_client: redis.Redis
) -> None:
    acct = "acct-busy"
    queue = RedisAccountQueue(res)
    holder = res.account_lock(acct)
    assert holder.acquire(arrival=queue.arrival(acct, "b-1"), fence=False)
    try:
        late = res.account_lock(acct)
        rider = res.gateway.account_start(acct)
        assert rider is not None
        assert not late.acquire(arrival=queue.arrival(acct, "b-2"), fence=False, rider=rider)
        assert redis_client.get(res.keys.waiting(acct)) == b"b-2"
        assert not redis_client.exists(res.gateway.tokens.lock_key(acct))
        assert not redis_client.exists(res.gateway.pacer.key(acct))
        assert not res.gateway.pacer._leases
    finally:
        holder.release()


@dataclass(frozen=True)
class Held:
    """An account's lock taken with a start rider: what its release gives back."""

    lock: AccountLock
    arrival: Arrival
    token_lock: str  # the refresh lock the start took (the account has no token yet)
    pace_key: str
    leased_to: float  # the pacing `tat` the start's lease left, in server ms


def _taken_with_rider(res: runtime.Runtime, acct: str) -> Held:
    lock = res.account_lock(acct)
    rider = res.gateway.account_start(acct)
    assert rider is not None
    arrival = RedisAccountQueue(res).arrival(acct, "b-1")
    assert lock.acquire(arrival=arrival, rider=rider)
    pace_key = res.gateway.pacer.key(acct)
    leased_to = float(res.redis.hget(pace_key, "tat") or 0)
    return Held(lock, arrival, res.gateway.tokens.lock_key(acct), pace_key, leased_to)


def test_a_start_that_sends_nothing_gives_its_refresh_lock_and_lease_back_as_it_releases(
    res: runtime.Runtime, gateway_sim: SimHandle, redis_client: redis.Redis, commands: list[str]
) -> None:
    """A holder that finds nothing due still took the refresh lock (no token yet) and a
    lease of pacing slots: its lock's release gives both back in its own round trip
    (lua/account_end.lua), so no other process waits for the refresh lock's TTL, and the
    next holder's first slot is one interval away, not the lease's window."""
    acct = "acct-idle"
    held = _taken_with_rider(res, acct)
    assert redis_client.exists(held.token_lock)  # taken at the start
    assert res.gateway.pacer._leases.get(acct) is not None  # a lease kept, no slot used
    commands.clear()
    end = res.gateway.account_end(acct)
    assert end is not None and commands == []  # nothing sent before the release
    assert held.lock.release(held.arrival, end)
    assert commands == ["account_end"]
    assert held.lock.marked is False
    assert not redis_client.exists(held.token_lock) and not redis_client.exists(held.lock.key)
    seconds, micros = redis_client.time()
    given_to = float(redis_client.hget(held.pace_key, "tat") or 0)
    assert given_to < held.leased_to
    assert given_to <= seconds * 1000 + micros / 1000 + 1000 / res.settings.rate_for(acct)
    assert not res.gateway.pacer._leases and res.gateway.account_end(acct) is None
    assert gateway_sim.ledger()["tokens_issued"] == 0


def test_an_end_rider_gives_back_even_when_the_lock_was_lost(
    res: runtime.Runtime, redis_client: redis.Redis
) -> None:
    """The lock expired under the holder (a pause): its release changes nothing of the lock,
    but the lease's rest and the refresh lock, each owner-checked, still go back."""
    held = _taken_with_rider(res, "acct-lost")
    redis_client.set(held.lock.key, "someone-else")  # taken over after an expiry
    end = res.gateway.account_end("acct-lost")
    assert not held.lock.release(held.arrival, end)
    assert redis_client.get(held.lock.key) == b"someone-else"
    assert not redis_client.exists(held.token_lock)
    assert float(redis_client.hget(held.pace_key, "tat") or 0) < held.leased_to


def test_an_end_rider_without_an_arrival_is_refused_before_anything_is_sent(
    res: runtime.Runtime, redis_client: redis.Redis
) -> None:
    held = _taken_with_rider(res, "acct-no-arrival")
    end = res.gateway.account_end("acct-no-arrival")
    assert end is not None
    with pytest.raises(ValueError, match="end rider"):
        held.lock.release(rider=end)
    assert held.lock.held and redis_client.exists(held.lock.key)  # still ours, untouched
    assert held.lock.release(held.arrival, end)
    assert not redis_client.exists(held.token_lock)
