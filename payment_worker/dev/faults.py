"""Faults for a local cluster, and how long each stalls the accounts it touches (issue 15).

Used by ``bench/recovery.py`` and ``tests/integration/test_recovery.py``. Each fault returns
a :class:`Fault`: its kind, when it struck (on the gateway simulator's clock) and the
accounts it affected; :func:`measure` then waits for each affected account's next gateway
request and returns the stall of each: its longest silence after the fault (from the
fault to its next request, or between two requests), from the simulator's request log.

Who holds what is read from Redis: a lock's value is ``<holder>:<token>`` and a holder id
ends in ``-<pid>-<random>``, so the worker process holding an account is known exactly.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from payment_worker.dev.local_cluster import LocalCluster, ManagedProcess
from payment_worker.locks.liveness import holder_of
from payment_worker.redis_keys import RedisKeys


@dataclass
class Fault:
    """One fault: what, when (simulator clock), whom it hit."""

    kind: str
    at: float
    affected: list[str]
    victim_holders: set[str] = field(default_factory=set)
    stalls: dict[str, float | None] = field(default_factory=dict)  # filled by measure()


@dataclass
class FaultTarget:
    """What the faults act on and read: the cluster, the Redis databases, the accounts."""

    cluster: LocalCluster
    app: redis.Redis
    broker: redis.Redis
    accounts: Sequence[str]
    has_work: Callable[[str], bool]  # whether the account has open items (Postgres)
    keys: RedisKeys = field(default_factory=RedisKeys)

    @property
    def sim_url(self) -> str:
        assert self.cluster.sim_url is not None
        return self.cluster.sim_url


def holder_pid(holder_id: str) -> int | None:
    """The pid inside a holder id (``<host>-<pid>-<random>``)."""
    parts = holder_id.rsplit("-", 2)
    try:
        return int(parts[-2]) if len(parts) == 3 else None
    except ValueError:
        return None


def holders(target: FaultTarget) -> dict[str, str]:
    """account -> holder id, for the accounts whose lock is held now."""
    accounts = list(target.accounts)
    values = target.app.mget([target.keys.lock(a) for a in accounts])
    out = {}
    for acct, value in zip(accounts, values, strict=True):
        holder = holder_of(value)
        if holder is not None:
            out[acct] = holder
    return out


def sim_now(target: FaultTarget) -> float:
    """The simulator's clock now (the time base of its request log)."""
    reply = httpx.get(f"{target.sim_url}/_sim/requests", params={"account_id": ""}, timeout=10)
    return float(reply.json()["now"])


def requests_after(target: FaultTarget, account: str, since: float) -> list[list[Any]]:
    """The account's requests after ``since`` (simulator clock): [t, endpoint, status]."""
    reply = httpx.get(
        f"{target.sim_url}/_sim/requests",
        params={"account_id": account, "since": since},
        timeout=10,
    )
    out: list[list[Any]] = reply.json()["requests"]
    return out


def measure(target: FaultTarget, fault: Fault, window: float) -> Fault:
    """Wait until ``window`` seconds after the fault, then fill ``fault.stalls``: for each
    affected account, its longest silence in that window (the time from the fault to its
    first request, or between two of its requests, or from its last request to the end of
    the window while it still has work). None: its last silence was still running at the
    end (not resumed within the window). Accounts that had no work and sent nothing are
    dropped.

    The longest silence, not just the first request after the fault: after a lock-store
    flush or a SIGTERM the old holder sends on for a moment, and the account's real stall is
    the hand-over that follows; a request of a killed or paused worker that was already on
    the wire only splits the silence, never hides it.
    """
    time.sleep(max(0.0, fault.at + window - sim_now(target)))
    end = sim_now(target)
    for acct in fault.affected:
        times = [float(r[0]) for r in requests_after(target, acct, fault.at)]
        points = [fault.at, *times]
        open_ended = target.has_work(acct)
        if open_ended:
            points.append(end)
        elif not times:
            continue
        gaps = [b - a for a, b in itertools.pairwise(points)]
        longest = max(gaps) if gaps else 0.0
        trailing = open_ended and gaps and gaps[-1] == longest and longest > 1.0
        fault.stalls[acct] = None if trailing else longest
    fault.affected = sorted(fault.stalls)
    return fault


def _worker_of(target: FaultTarget, holder_id: str) -> ManagedProcess | None:
    pid = holder_pid(holder_id)
    return next((w for w in target.cluster.workers() if w.pid == pid), None)


def busiest_worker(target: FaultTarget) -> tuple[ManagedProcess, set[str], list[str]] | None:
    """The worker holding the most accounts that still have work: (worker, its holder ids,
    those accounts), or None when no worker holds anything."""
    by_worker: dict[int, tuple[ManagedProcess, set[str], list[str]]] = {}
    for acct, holder in holders(target).items():
        worker = _worker_of(target, holder)
        if worker is None or not target.has_work(acct):
            continue
        entry = by_worker.setdefault(worker.pid, (worker, set(), []))
        entry[1].add(holder)
        entry[2].append(acct)
    if not by_worker:
        return None
    return max(by_worker.values(), key=lambda e: len(e[2]))


def wait_for_holder(target: FaultTarget, timeout: float = 30.0) -> None:
    """Wait until some worker holds an account that has work (a fault must hit a holder)."""
    deadline = time.monotonic() + timeout
    while busiest_worker(target) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no worker holds an account with work")
        time.sleep(0.1)


# --- the faults ------------------------------------------------------------------------------


def kill_holder(target: FaultTarget) -> Fault:
    """SIGKILL the worker holding the most accounts (its process group: a crash)."""
    wait_for_holder(target)
    found = busiest_worker(target)
    assert found is not None
    worker, victim, affected = found
    at = sim_now(target)
    worker.kill()
    return Fault("SIGKILL", at, affected, victim)


def pause_holder(target: FaultTarget) -> tuple[Fault, ManagedProcess]:
    """SIGSTOP the worker holding the most accounts; the caller resumes it (SIGCONT)."""
    wait_for_holder(target)
    found = busiest_worker(target)
    assert found is not None
    worker, victim, affected = found
    at = sim_now(target)
    worker.pause()
    return Fault("SIGSTOP", at, affected, victim), worker


def flush_lock_store(target: FaultTarget) -> Fault:
    """FLUSHDB of the application Redis database: locks, liveness keys, marks, tokens."""
    wait_for_holder(target)
    affected = [a for a in holders(target) if target.has_work(a)]
    at = sim_now(target)
    target.app.flushdb()
    return Fault("lock-store FLUSHDB", at, affected)


def flush_broker(target: FaultTarget, lost: Sequence[str] = ()) -> Fault:
    """FLUSHDB of the broker's Redis database: every queued and unacked message is gone.
    Affected: accounts with work that nobody holds (they wait for a message), and ``lost``
    (accounts whose only message the caller left unpublished, as if it was flushed)."""
    held = holders(target)
    affected = sorted({a for a in target.accounts if a not in held and target.has_work(a)})
    affected = sorted(set(affected) | set(lost))
    at = sim_now(target)
    target.broker.flushdb()
    return Fault("broker FLUSHDB", at, affected)


def cut_database(target: FaultTarget, terminate: Callable[[], int]) -> Fault:
    """Every database connection of the workers is terminated (``terminate`` runs
    ``pg_terminate_backend``: the same AdminShutdown, SQLSTATE 57P01, as a fast restart)."""
    wait_for_holder(target)
    affected = [a for a in holders(target) if target.has_work(a)]
    at = sim_now(target)
    terminate()
    return Fault("Postgres backends terminated", at, affected)


def wait_alive(target: FaultTarget, worker: ManagedProcess, timeout: float = 60.0) -> None:
    """Wait until ``worker`` has its liveness key (it is ready to take work)."""
    deadline = time.monotonic() + timeout
    pattern = target.keys.alive(f"*-{worker.pid}-*")
    while not target.app.keys(pattern):
        if time.monotonic() > deadline or not worker.alive():
            raise TimeoutError(f"worker {worker.name} did not become ready")
        time.sleep(0.1)


def terminate_holder(target: FaultTarget, worker: ManagedProcess) -> Fault:
    """SIGTERM (warm shutdown) of ``worker``: it hands its accounts back."""
    pid_holders = {h for h in holders(target).values() if holder_pid(h) == worker.pid}
    affected = [a for a, h in holders(target).items() if h in pid_holders and target.has_work(a)]
    at = sim_now(target)
    worker.signal(signal.SIGTERM)
    return Fault("SIGTERM (rolling restart)", at, affected, pid_holders)
