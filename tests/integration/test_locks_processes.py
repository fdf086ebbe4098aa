"""The account lock across real processes: contention, SIGKILL, SIGSTOP past the TTL."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import redis
from sqlalchemy import Engine, text

from payment_worker.db.engine import make_engine
from payment_worker.locks.account_lock import AccountLock, lock_is_held
from payment_worker.redis_keys import RedisKeys
from tests.conftest import ROOT, PwEnv
from tests.lock_helpers import COUNTER_KEY, GATEWAY_CALLS_KEY, fenced_write

# run alone, after the parallel part of `make test`: 100 processes contend, and starvation is
# bounded in time
pytestmark = pytest.mark.exclusive

ACCOUNT = "acct-proc"


@pytest.fixture
def engine(pw_env: PwEnv) -> Iterator[Engine]:
    eng = make_engine(pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    yield eng
    eng.dispose()


def _helper(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.lock_helpers", *args]


def _contend(tmp_path: Path, n: int, **opts: Any) -> list[dict[str, Any]]:
    args = ["contend", "--account", ACCOUNT, "--n", str(n), "--out", str(tmp_path)]
    for name, value in opts.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    # its own session: on any failure the whole group (launcher and children) is killed
    proc = subprocess.Popen(
        _helper(*args),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("child-*.json"))]
    assert len(results) == n
    for res in results:
        assert "error" not in res, res
    return results


def _assert_mutual_exclusion(results: list[dict[str, Any]], r: redis.Redis) -> int:
    intervals = sorted(iv for res in results for iv in res["intervals"])
    for (_, prev_end, prev_token), (start, _, token) in itertools.pairwise(intervals):
        assert start >= prev_end, "two holders at once"
        assert token > prev_token, "fencing tokens must grow in holding order"
    # the non-atomic read-modify-write in every interval lost no increment
    assert int(r.get(COUNTER_KEY) or 0) == len(intervals)
    return len(intervals)


def test_100_processes_each_get_the_lock_once_and_never_overlap(
    pw_env: PwEnv, redis_client: redis.Redis, tmp_path: Path
) -> None:
    results = _contend(tmp_path, 100, hold_ms=10, ttl_ms=1000, timeout=60)
    assert all(len(res["intervals"]) == 1 for res in results), "everyone gets it"
    assert _assert_mutual_exclusion(results, redis_client) == 100
    assert not lock_is_held(redis_client, ACCOUNT)


def test_50_contenders_none_starves(
    pw_env: PwEnv, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Everyone loops acquire/release for a few seconds; the FIFO handoff serves all alike."""
    results = _contend(tmp_path, 50, hold_ms=5, ttl_ms=1000, timeout=30, duration=4)
    counts = [len(res["intervals"]) for res in results]
    total = _assert_mutual_exclusion(results, redis_client)
    assert min(counts) >= 2, counts
    assert min(counts) >= max(counts) / 3, counts
    # a wait never exceeds a few rounds of the whole queue
    longest_wait = max(w for res in results for w in res["waits"])
    round_time = 4.0 * 50 / total  # seconds for all 50 to get it once
    assert longest_wait < 3 * round_time + 2.0, (longest_wait, round_time)


class Holder:
    """A ``lock_helpers hold`` process: takes the lock and obeys commands."""

    def __init__(self, ttl_ms: int, timeout: float = 0, *, read_first: bool = True) -> None:
        self.proc = subprocess.Popen(
            _helper(
                "hold",
                "--account",
                ACCOUNT,
                "--ttl-ms",
                str(ttl_ms),
                "--margin-ms",
                "100",
                "--timeout",
                str(timeout),
            ),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.first = self.read() if read_first else {}

    def read(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        assert line, "holder process ended"
        return dict(json.loads(line))

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _insert_tx(engine: Engine) -> int:
    with engine.begin() as conn:
        batch_pk = conn.execute(
            text(
                "INSERT INTO batches (batch_id, account_id, fingerprint, item_count)"
                " VALUES ('b-1', :a, 'fp', 1) RETURNING id"
            ),
            {"a": ACCOUNT},
        ).scalar_one()
        return int(
            conn.execute(
                text(
                    "INSERT INTO transactions (batch_pk, account_id, transaction_id, amount,"
                    " currency, beneficiary, idempotency_key)"
                    " VALUES (:bp, :a, 'tx-1', 100, 'IDR', '{}'::jsonb, 'k-1') RETURNING id"
                ),
                {"bp": batch_pk, "a": ACCOUNT},
            ).scalar_one()
        )


def test_holder_killed_with_sigkill_frees_the_lock_within_ttl(
    pw_env: PwEnv, redis_client: redis.Redis, engine: Engine
) -> None:
    ttl_ms = 800
    holder = Holder(ttl_ms)
    try:
        assert holder.first["event"] == "acquired"
        assert lock_is_held(redis_client, ACCOUNT)
        time.sleep(0.5)  # let the watchdog renew at least once
        waiter = AccountLock(
            redis_client, ACCOUNT, engine=engine, ttl_ms=ttl_ms, safety_margin_ms=100
        )
        os.kill(holder.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        holder.proc.wait(5)
        while lock_is_held(redis_client, ACCOUNT):
            assert time.monotonic() - killed <= ttl_ms / 1000 + 0.05
            time.sleep(0.01)
        freed_after = time.monotonic() - killed
        assert freed_after <= ttl_ms / 1000 + 0.05
        assert waiter.acquire()
        assert waiter.fence_token == holder.first["fence"] + 1
        waiter.release()
    finally:
        holder.close()


def test_blocking_waiter_takes_over_from_a_killed_holder(
    pw_env: PwEnv, redis_client: redis.Redis, engine: Engine
) -> None:
    """Nobody releases: the queued waiter's fallback check takes the expired lock."""
    ttl_ms = 600
    holder = Holder(ttl_ms)
    try:
        assert holder.first["event"] == "acquired"
        waiter = AccountLock(
            redis_client, ACCOUNT, engine=engine, ttl_ms=ttl_ms, safety_margin_ms=100
        )
        warm = AccountLock(redis_client, "warm", engine=engine, ttl_ms=ttl_ms, safety_margin_ms=100)
        assert warm.acquire() and warm.release()  # connect the fencing pool beforehand
        os.kill(holder.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert waiter.acquire(blocking=True, timeout=5)
        # expiry (<= TTL) plus at most one fallback slice (TTL/3), plus scheduling slack
        assert time.monotonic() - killed <= ttl_ms / 1000 * (4 / 3) + 0.25
        waiter.release()
    finally:
        holder.close()


def _wait_for(cond: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_killed_waiter_is_skipped_by_the_handoff(
    pw_env: PwEnv, redis_client: redis.Redis, engine: Engine
) -> None:
    first = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=2000, safety_margin_ms=100)
    assert first.acquire()
    queue = RedisKeys("pw").lock_queue(ACCOUNT)
    dead = Holder(300, timeout=30, read_first=False)  # queues behind `first`
    try:
        _wait_for(lambda: redis_client.llen(queue) == 1)
        dead_token = redis_client.lindex(queue, 0)
        os.kill(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait(5)
        # its lease (2 x TTL/3 + 1 s) runs out while `first` keeps the lock
        time.sleep(1.4)
        first.ensure_held()
        second = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=300, safety_margin_ms=100)
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(second.acquire(blocking=True, timeout=5)))
        t.start()
        _wait_for(lambda: redis_client.lrange(queue, 0, -1) not in ([], [dead_token]))
        released = time.monotonic()
        assert first.release()
        t.join(5)
        assert got == [True]
        assert time.monotonic() - released < 0.3  # handed over at once, not after a TTL
        assert redis_client.llen(queue) == 0  # the dead waiter is gone from the queue
        second.release()
    finally:
        dead.close()


def test_paused_holder_is_fenced_out_and_stops_before_the_gateway(
    pw_env: PwEnv, redis_client: redis.Redis, engine: Engine
) -> None:
    ttl_ms = 500
    pk = _insert_tx(engine)
    holder = Holder(ttl_ms)
    try:
        assert holder.first["event"] == "acquired"
        old_token = holder.first["fence"]
        assert holder.ask(f"write {pk} dispatching") == {"event": "write", "result": "ok"}
        os.kill(holder.proc.pid, signal.SIGSTOP)
        time.sleep(ttl_ms / 1000 + 0.3)  # past the TTL: the key expires
        assert not lock_is_held(redis_client, ACCOUNT)
        new = AccountLock(redis_client, ACCOUNT, engine=engine, ttl_ms=5000, safety_margin_ms=100)
        assert new.acquire()
        assert new.fence_token == old_token + 1
        assert fenced_write(engine, ACCOUNT, new.fence_token, pk, "unknown") == "ok"
        os.kill(holder.proc.pid, signal.SIGCONT)
        # the paused holder's next write, straight to the database: the fence rejects it
        assert holder.ask(f"write {pk} succeeded") == {"event": "write", "result": "fenced_out"}
        # the processing step checks the lock first: no gateway call happens
        step = holder.ask(f"step {pk} succeeded")
        assert step["result"] == "lock_lost"
        assert int(redis_client.get(GATEWAY_CALLS_KEY) or 0) == 0
        assert holder.ask("ensure")["result"] == "lost"
        # its release is a no-op: the new holder keeps the lock
        rel = holder.ask("release")
        assert rel["result"] is False
        assert rel["on_lost"] and rel["on_lost"][0] in ("deadline", "stolen")
        new.ensure_held()
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT status, fence_token FROM transactions WHERE id = :id"), {"id": pk}
            ).one()
        assert tuple(row) == ("unknown", new.fence_token)
        new.release()
    finally:
        if holder.proc.poll() is None:
            os.kill(holder.proc.pid, signal.SIGCONT)
        holder.close()


def test_holder_process_keeps_the_lock_while_it_works(
    pw_env: PwEnv, redis_client: redis.Redis, engine: Engine
) -> None:
    """Renewal in a real process: 10 x TTL of work, the lock stays, steps go through."""
    ttl_ms = 300
    pk = _insert_tx(engine)
    holder = Holder(ttl_ms)
    try:
        assert holder.first["event"] == "acquired"
        rival = AccountLock(
            redis_client, ACCOUNT, engine=engine, ttl_ms=ttl_ms, safety_margin_ms=100
        )
        end = time.monotonic() + 10 * ttl_ms / 1000
        steps = 0
        while time.monotonic() < end:
            assert holder.ask("ensure")["result"] == "held"
            assert not rival.acquire()
            steps += 1
            time.sleep(0.1)
        assert steps >= 20
        assert holder.ask(f"step {pk} dispatching")["result"] == "ok"
        assert int(redis_client.get(GATEWAY_CALLS_KEY) or 0) == 1
        assert holder.ask("release")["result"] is True
        assert not lock_is_held(redis_client, ACCOUNT)
    finally:
        holder.close()
