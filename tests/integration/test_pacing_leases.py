"""Pacing slots leased in blocks (gateway/pacing.py): the quota holds across real processes.

Three processes of two threads each send payments of one account for two seconds against
the simulator (real Redis, real HTTP). The moments the requests are let go, on the
machine's shared monotonic clock, never exceed the quota: at most ``rate x L + 2``
requests in any span of ``L`` seconds (one script per request allows ``rate x L + 1``), and
the simulator, which enforces the same quota, answers no 429. No process is starved, and
leasing blocks takes several times fewer pacing scripts per request (counted by the
processes and by the Redis server) than one script per request.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import redis

from payment_worker import lua
from payment_worker.gateway.pacing import Pacer
from payment_worker.gateway.pacing_lease import WINDOW
from tests.conftest import ROOT, PwEnv
from tests.sim_fixtures import SimHandle

# run alone, after the parallel part of `make test`: it counts EVALSHA calls server-wide (INFO
# commandstats)
pytestmark = pytest.mark.exclusive

ACCOUNT = "acct-lease"
RATE = 50.0
SECONDS = 2.0
PROCESSES = 3


def give_back(client: redis.Redis, pacer: Pacer, account_id: str) -> bool:
    """What a holder done with the account sends, as the drain sends it: the ``tat``
    :meth:`Pacer.returned` hands over, given back by the lock's release script
    (``lua/account_end.lua``; no lock is held here, so the release part changes nothing).
    True when given back; no script at all when there is nothing to give."""
    given = pacer.returned(account_id)
    if given is None:
        return False
    tat, free_ms = given
    keys = [f"pw:test-lock:{{{account_id}}}{part}" for part in ("", ":queue", ":waiters", ":mark")]
    end = client.register_script(lua.load("account_end"))
    reply = end(
        keys=[*keys, pacer.key(account_id), f"pw:test-token-lock:{{{account_id}}}"],
        args=["", 1, tat, free_ms, ""],
    )
    return int(reply[2]) == 1


def _most_in_any_span(times: list[float], span: float) -> int:
    """The largest number of ``times`` inside one closed interval of length ``span``."""
    times = sorted(times)
    return max(bisect.bisect_right(times, t + span) - i for i, t in enumerate(times))


def _run(lease_seconds: float, processes: int, threads: int) -> list[dict[str, Any]]:
    env = dict(
        os.environ,
        GATEWAY_RATE_PER_SECOND=str(RATE),
        GATEWAY_PACING_LEASE_SECONDS=str(lease_seconds),
    )
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "tests.pacing_helpers", "--account", ACCOUNT),
                *("--name", f"l{lease_seconds}-p{n}", "--seconds", str(SECONDS)),
                *("--threads", str(threads)),
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(processes)
    ]
    # all up, each with its token: then go together
    for proc in procs:
        assert proc.stdout is not None
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            pass  # its log lines
        assert line, proc.stderr.read() if proc.stderr else ""
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _evalsha(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def _outcomes(results: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in results:
        for k, v in r["outcomes"].items():
            total[k] = total.get(k, 0) + v
    return total


def test_the_quota_holds_across_processes(
    pw_env: PwEnv, gateway_sim: SimHandle, redis_client: redis.Redis
) -> None:
    # the processes are not coordinated by an account lock: let requests overlap
    gateway_sim.configure(rate=RATE, max_in_flight=10)
    results = _run(0.1, PROCESSES, 2)
    sent = [t for r in results for t in r["sent"]]
    assert sent, results
    n = len(sent)
    spans = {span: _most_in_any_span(sent, span) for span in (0.1, 0.25, 1.0)}
    print(
        f"\n{PROCESSES} processes x 2 threads, blocks of {int(RATE * 0.1)}: {n} requests,"
        f" per process {[len(r['sent']) for r in results]}, most in any span {spans}"
    )
    # the quota: never more than one request per interval, whichever process sent it
    for span, most in spans.items():
        assert most <= RATE * span + 2, (span, most)
    ledger = gateway_sim.ledger()
    assert ledger["http_429_by_cause"]["rate"] == 0, ledger["http_429_by_cause"]
    assert set(_outcomes(results)) == {"succeeded:201"}, _outcomes(results)
    # nobody starves: each process gets a fair part
    for r in results:
        assert len(r["sent"]) >= 0.1 * n, [len(x["sent"]) for x in results]


def test_one_holder_runs_a_fraction_of_the_scripts(
    pw_env: PwEnv, gateway_sim: SimHandle, redis_client: redis.Redis
) -> None:
    """The production shape: the account lock gives the account to one thread at a time."""
    gateway_sim.configure(rate=RATE)
    per_request: dict[float, tuple[float, float]] = {}
    for lease_seconds in (0.0, 0.1):
        gateway_sim.reset()
        gateway_sim.configure(rate=RATE)
        before = _evalsha(redis_client)
        [result] = _run(lease_seconds, 1, 1)
        evalsha = _evalsha(redis_client) - before
        n = len(result["sent"])
        assert n > 0 and set(result["outcomes"]) == {"succeeded:201"}, result["outcomes"]
        assert _most_in_any_span(result["sent"], 1.0) <= RATE + 2
        assert gateway_sim.ledger()["http_429_by_cause"]["rate"] == 0
        per_request[lease_seconds] = (result["scripts"] / n, evalsha / n)
        print(
            f"\nlease {lease_seconds}s, one thread: {n} requests, pacing scripts/request"
            f" {result['scripts'] / n:.2f}, EVALSHA/request at the server {evalsha / n:.2f}"
        )
    assert per_request[0.0][0] >= 1.0  # one script per request
    # blocks of up to 5 (2, 4, then 5): about a fifth of a script per request
    assert per_request[0.1][0] <= 0.35, per_request
    assert per_request[0.1][1] <= per_request[0.0][1] - 0.6, per_request  # the server agrees


def test_a_cooldown_drops_the_own_lease_and_another_process_lease_runs_out(
    redis_client: redis.Redis,
) -> None:
    rate = 100.0  # blocks of 10 slots, 10 ms apart: a window of 100 ms
    mine = Pacer(redis_client, "pw", lease_seconds=0.1)
    # a 429 seen by this process: recording the cooldown drops its own lease at once
    assert mine.acquire("acct-own", rate, max_wait=1.0).acquired  # 9 slots left
    mine.cooldown("acct-own", 0.3)
    t0 = time.monotonic()
    assert mine.acquire("acct-own", rate, max_wait=2.0).acquired
    assert time.monotonic() - t0 >= 0.3  # not the next leased slot 10 ms later

    # a 429 seen by another process: this one's lease is not recalled, but it ends with its
    # window (at most 10 slots, within 100 ms), then nothing before the cooldown's end
    other = Pacer(redis_client, "pw", lease_seconds=0.1)
    assert other.acquire(ACCOUNT, rate, max_wait=1.0).acquired
    leased_at = time.monotonic()
    mine.cooldown(ACCOUNT, 0.5)
    cooled_at = time.monotonic()
    taken = [leased_at]
    while taken[-1] < cooled_at + 0.4:
        assert other.acquire(ACCOUNT, rate, max_wait=2.0).acquired
        taken.append(time.monotonic())
    during = [t for t in taken if t < cooled_at + 0.5]
    assert len(during) <= 10  # its block, no more
    assert all(t - leased_at <= 0.1 + 0.05 for t in during)  # within its window (+ slack)
    assert taken[-1] >= cooled_at + 0.5  # then Retry-After holds for it too


def test_a_holder_done_with_the_account_gives_the_rest_of_its_lease_back(
    redis_client: redis.Redis,
) -> None:
    rate = 10.0  # a block of 10 slots, 100 ms apart: a window of 1 s
    first = Pacer(redis_client, "pw", lease_seconds=1.0)
    nxt = Pacer(redis_client, "pw", lease_seconds=1.0)  # the account's next holder
    assert first.acquire("acct-back", rate, max_wait=1.0).acquired  # 9 slots left
    # without the give-back, a next holder's first slot lies past the window (~1 s); a probe
    # of its own (a pacer remembers a closed account locally for that long)
    probe = Pacer(redis_client, "pw", lease_seconds=1.0)
    assert probe.try_acquire("acct-back", rate, ahead=0.0) > 0.8
    assert give_back(redis_client, first, "acct-back")
    t0 = time.monotonic()
    assert nxt.acquire("acct-back", rate, max_wait=1.0).acquired
    waited = time.monotonic() - t0
    # an interval (and the 2 % a second is counted longer) after the give-back, not the
    # window
    assert waited <= 1 / rate + (WINDOW - 1) + 0.15
    # the next holder leased since: a late give-back of the first one changes nothing
    assert not give_back(redis_client, first, "acct-back")  # its lease is gone already
    stale = Pacer(redis_client, "pw", lease_seconds=1.0)
    assert stale.acquire("acct-stale", rate, max_wait=1.0).acquired
    assert nxt.acquire("acct-stale", rate, max_wait=0.2).acquired is False  # a window ahead
    # another lease followed this one's (forced here by moving the timeline on): no give-back
    redis_client.hset(stale.key("acct-stale"), "tat", "99999999999999.000")
    assert not give_back(redis_client, stale, "acct-stale")
    assert redis_client.hget(stale.key("acct-stale"), "tat") == b"99999999999999.000"


def test_a_spent_lease_costs_no_give_back_script(redis_client: redis.Redis) -> None:
    rate = 100.0
    pacer = Pacer(redis_client, "pw", lease_seconds=0.02)  # blocks of 2 slots, 20 ms
    assert pacer.acquire("acct-spent", rate, max_wait=1.0).acquired
    assert pacer.acquire("acct-spent", rate, max_wait=1.0).acquired  # the block is spent
    # and its last request an interval back, its last second leaving room (below: not yet)
    time.sleep(1 / rate + 0.05)
    before = redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert not give_back(redis_client, pacer, "acct-spent")
    assert not give_back(redis_client, pacer, "acct-none")  # never leased here
    after = redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert after == before


def test_a_spent_lease_whose_last_request_just_left_is_given_back(
    redis_client: redis.Redis,
) -> None:
    """A slot is spent from its actual use, so the block's last request may leave just
    before its window ends: the stored timeline then lies less than an interval after it.
    Given back, the next holder starts an interval after the release (before, nothing was
    sent for a spent lease and the next one could go at once: a review found it)."""
    rate = 10.0  # blocks of 2 slots, 100 ms apart
    first = Pacer(redis_client, "pw", lease_seconds=0.2)
    nxt = Pacer(redis_client, "pw", lease_seconds=0.2)
    assert first.acquire("acct-late", rate, max_wait=1.0).acquired
    time.sleep(0.15)  # the second slot used late, near the window's end
    assert first.acquire("acct-late", rate, max_wait=1.0).acquired
    last = time.monotonic()
    assert give_back(redis_client, first, "acct-late")
    assert nxt.acquire("acct-late", rate, max_wait=1.0).acquired
    assert time.monotonic() - last >= 1 / rate - 0.01


def test_the_give_back_holds_the_next_holder_until_the_last_second_leaves_room(
    redis_client: redis.Redis,
) -> None:
    """The give-back sets the next free slot as far from now as ``Pacer.returned`` says,
    not an interval on: a holder whose last second of requests is full keeps the next
    holder, in another process, until the two together stay at floor(rate) in any second."""
    rate = 10.0  # blocks of 2 slots, 100 ms apart
    first = Pacer(redis_client, "pw", lease_seconds=0.2)
    nxt = Pacer(redis_client, "pw", lease_seconds=0.2)
    assert first.acquire("acct-full", rate, max_wait=1.0, held=True).acquired
    now = time.monotonic()
    # its last second: ten requests in the last half second (as if delays were made up)
    lease = first._leases["acct-full"]
    lease.recent.clear()
    lease.recent.extend(now - 0.5 + i * 0.05 for i in range(10))
    lease.last_use = lease.recent[-1]
    assert give_back(redis_client, first, "acct-full")
    assert nxt.acquire("acct-full", rate, max_wait=2.0, held=True).acquired
    # the oldest of the ten a second back (as the pacer counts it), not an interval after
    # the last
    assert time.monotonic() - (now - 0.5) >= WINDOW - 0.01


def test_a_give_back_after_the_timeline_expired_still_spaces_the_next_holder(
    redis_client: redis.Redis,
) -> None:
    """The timeline's key expires a second after its last leased slot; a holder past its
    lease sends on its own spacing for the rest of its drain. Its give-back found no key and
    wrote nothing, so the next holder could go at once (a review found it)."""
    rate = 10.0
    first = Pacer(redis_client, "pw", lease_seconds=0.2)
    nxt = Pacer(redis_client, "pw", lease_seconds=0.2)
    assert first.acquire("acct-long", rate, max_wait=1.0, held=True).acquired
    assert first.acquire("acct-long", rate, max_wait=1.0, held=True).acquired
    deadline = time.monotonic() + 5
    while redis_client.exists(first.key("acct-long")):  # expired: nothing renews it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert first.acquire("acct-long", rate, max_wait=1.0, held=True).acquired  # own spacing
    last = time.monotonic()
    assert first.scripts == 1
    assert give_back(redis_client, first, "acct-long")
    assert redis_client.pttl(first.key("acct-long")) > 1000  # kept past the slot it set
    assert nxt.acquire("acct-long", rate, max_wait=1.0, held=True).acquired
    assert time.monotonic() - last >= 1 / rate - 0.01


def test_a_lock_holder_past_its_lease_keeps_its_spacing_without_a_script(
    redis_client: redis.Redis,
) -> None:
    """A holder slower than the quota (real gateway latency) runs one script per drain."""
    rate = 100.0  # blocks of 10 slots, 10 ms apart: a window of 100 ms
    for held, scripts in ((True, 1), (False, 5)):
        pacer = Pacer(redis_client, "pw", lease_seconds=0.1)
        account = f"acct-slow-{held}"
        before = _evalsha(redis_client)
        taken = []
        for _ in range(5):
            assert pacer.acquire(account, rate, max_wait=1.0, held=held).acquired
            taken.append(time.monotonic())
            time.sleep(0.15)  # a request slower than the window
        assert pacer.scripts == scripts and _evalsha(redis_client) - before == scripts
        assert min(b - a for a, b in itertools.pairwise(taken)) >= 0.15


def test_a_lock_holder_never_goes_closer_than_half_an_interval_past_its_lease(
    redis_client: redis.Redis,
) -> None:
    rate = 50.0  # blocks of 5 slots, 20 ms apart: a window of 100 ms
    pacer = Pacer(redis_client, "pw", lease_seconds=0.1)
    used = []
    end = time.monotonic() + 0.6
    while time.monotonic() < end:  # as fast as it may: the lease, then its own spacing
        assert pacer.acquire("acct-fast", rate, max_wait=1.0, held=True).acquired
        # the moment the pacer let the request go (a stamp taken after the call returns
        # would move with the machine's load)
        used.append(pacer._leases["acct-fast"].last_use)
    # without the spacing the gaps would be a fraction of a millisecond; a late wake-up is
    # made up by half an interval at most
    assert min(b - a for a, b in itertools.pairwise(used)) >= 0.5 / rate - 1e-9
    assert _most_in_any_span(used, 0.2) <= 0.2 * rate + 2
    assert len(used) <= 0.6 * rate + 2
    assert pacer.scripts == 1


def test_a_holder_that_kept_its_spacing_hands_it_to_the_next_holder(
    redis_client: redis.Redis,
) -> None:
    rate = 10.0  # blocks of 2 slots, 100 ms apart: a window of 200 ms
    first = Pacer(redis_client, "pw", lease_seconds=0.2)
    nxt = Pacer(redis_client, "pw", lease_seconds=0.2)  # another process, the next holder
    assert first.acquire("acct-hand", rate, max_wait=1.0, held=True).acquired
    time.sleep(0.25)  # past the window: the stored timeline lies behind now
    assert first.acquire("acct-hand", rate, max_wait=1.0, held=True).acquired
    last = time.monotonic()
    assert first.scripts == 1  # that request went on the holder's own spacing
    # done right after it: the stored timeline must learn that request, or the next holder
    # would go at once
    assert give_back(redis_client, first, "acct-hand")
    assert nxt.acquire("acct-hand", rate, max_wait=1.0, held=True).acquired
    assert time.monotonic() - last >= 1 / rate - 0.01  # the server's clock vs this one's

    # an interval after its last request (and its last second's requests a second back), a
    # holder done with the account runs no script
    assert first.acquire("acct-quiet", rate, max_wait=1.0, held=True).acquired
    time.sleep(0.25)
    assert first.acquire("acct-quiet", rate, max_wait=1.0, held=True).acquired
    time.sleep(1 / rate + 0.05)
    before = _evalsha(redis_client)
    assert not give_back(redis_client, first, "acct-quiet")
    assert _evalsha(redis_client) == before


def test_one_slot_leases_keep_a_script_per_request_even_for_a_holder(
    redis_client: redis.Redis,
) -> None:
    pacer = Pacer(redis_client, "pw", lease_seconds=0.0)  # GATEWAY_PACING_LEASE_SECONDS=0
    for _ in range(3):
        assert pacer.acquire("acct-one", 100.0, max_wait=1.0, held=True).acquired
        time.sleep(0.02)
    assert pacer.scripts == 3


def test_the_sweep_keeps_a_lease_whose_spacing_still_holds(redis_client: redis.Redis) -> None:
    rate = 10.0  # blocks of 2 slots, 100 ms apart
    pacer = Pacer(redis_client, "pw", lease_seconds=0.2)
    assert pacer.acquire("acct-swept", rate, max_wait=1.0, held=True).acquired
    time.sleep(0.25)
    assert pacer.acquire("acct-swept", rate, max_wait=1.0, held=True).acquired  # kept
    pacer._sweep(time.monotonic())  # the process's many leases are swept now and then
    # the kept request is less than an interval back: the next one still waits for it
    assert pacer.try_acquire("acct-swept", rate, held=True) > 0
    assert pacer.scripts == 1
