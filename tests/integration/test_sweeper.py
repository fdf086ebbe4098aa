"""The sweeper (``run_sweep``) against real PostgreSQL and Redis, with the real broker.

docs/processing.md, "Sweeper": one pass at a time (a Redis lock), accounts with due open
items and no write for SWEEPER_STALE_AFTER and no live lock holder get one batch enqueued, at
most once per SWEEPER_RESEND_AFTER, and the sweeper never calls the gateway. (The liveness
takeover by the sweeper is in test_recovery.py.) Publishes are observed
in the broker itself: kombu's Redis transport keeps the ``payments`` queue as a Redis list.
Rows are made old with an UPDATE of ``updated_at``, not by sleeping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from prometheus_client import REGISTRY

from payment_worker import runtime
from payment_worker.db import stalls
from payment_worker.db import work as repo
from payment_worker.producer.submit import submit_batch
from payment_worker.worker.sweeper import run_sweep
from tests.conftest import ROOT, PwEnv, wait_until
from tests.integration.test_producer import broker_messages, make_batch
from tests.lock_helpers import proxied_redis
from tests.sim_fixtures import SimHandle

STALE = 1.0  # SWEEPER_STALE_AFTER of these tests, seconds


@pytest.fixture
def srt(pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[runtime.Runtime]:
    """The process runtime with a short stale period."""
    monkeypatch.setenv("SWEEPER_STALE_AFTER", str(STALE))
    # one repair message per account per STALE seconds (until a holder takes the account)
    monkeypatch.setenv("SWEEPER_RESEND_AFTER", str(STALE))
    runtime.reset()  # rebuilt from the setting above
    rt = runtime.current()
    assert rt.settings.sweeper_stale_after == STALE
    yield rt
    runtime.reset()


def _save(batch_id: str, account: str, rt: runtime.Runtime, n: int = 2) -> None:
    # enqueue=False: as if the broker had been down at submission
    data = make_batch(batch_id, account=account, n=n, tx=batch_id)
    assert submit_batch(data, runtime=rt, enqueue=False).status == "accepted"


def _age(db: psycopg.Connection[Any], seconds: float = 60.0) -> None:
    """Make every item look untouched for ``seconds`` (no sleep)."""
    db.execute("UPDATE transactions SET updated_at = now() - make_interval(secs => %s)", (seconds,))


def _sweeps(result: str) -> float:
    return REGISTRY.get_sample_value("payment_worker_sweeps_total", {"result": result}) or 0.0


def test_batch_saved_while_the_broker_was_down_is_reenqueued(
    srt: runtime.Runtime, pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    _save("b-1", "acct-1", srt)
    # fresh rows are not stalled: the sweeper must not race a normal submission
    assert run_sweep(srt) == {
        "result": "ok",
        "stalled": 0,
        "busy": 0,
        "queued": 0,
        "taken_over": 0,
        "reenqueued": [],
    }
    assert broker_messages(pw_env) == []
    _age(db_conn)
    assert run_sweep(srt) == {
        "result": "ok",
        "stalled": 1,
        "busy": 0,
        "queued": 0,
        "taken_over": 0,
        "reenqueued": ["b-1"],
    }
    assert broker_messages(pw_env) == ["b-1"]


def test_second_sweep_within_the_stale_period_publishes_nothing(
    srt: runtime.Runtime, pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    _save("b-1", "acct-1", srt)
    _age(db_conn)
    first = time.monotonic()
    assert run_sweep(srt)["reenqueued"] == ["b-1"]
    again = run_sweep(srt)
    assert time.monotonic() - first < STALE  # otherwise this check would prove nothing
    # still stalled (nobody processed it), but its repair message waits in the broker
    assert again == {
        "result": "ok",
        "stalled": 1,
        "busy": 0,
        "queued": 1,
        "taken_over": 0,
        "reenqueued": [],
    }
    assert broker_messages(pw_env) == ["b-1"]
    # while the repair message still waits in the broker, it is on its way: no second one
    time.sleep(STALE * 1.5)
    assert run_sweep(srt)["reenqueued"] == []
    # at most once per period, not once for ever: once the message is lost (the broker's
    # queue emptied), it is repaired again after the period
    redis.Redis.from_url(pw_env.broker_url).delete("payments")
    wait_until(lambda: run_sweep(srt)["reenqueued"] == ["b-1"], STALE * 3, "a second repair")
    assert time.monotonic() - first >= STALE * 0.9
    assert broker_messages(pw_env) == ["b-1"]


def test_accounts_whose_lock_is_held_are_busy_and_not_enqueued(
    srt: runtime.Runtime, pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    _save("b-held", "acct-held", srt)
    _save("b-free", "acct-free", srt)
    _age(db_conn)
    holder = srt.account_lock("acct-held")
    assert holder.acquire()
    try:
        result = run_sweep(srt)
        assert result == {
            "result": "ok",
            "stalled": 2,
            "busy": 1,
            "queued": 0,
            "taken_over": 0,
            "reenqueued": ["b-free"],
        }
        assert broker_messages(pw_env) == ["b-free"]
    finally:
        holder.release()
    # a busy account got no repair marker: once its lock is free it is repaired at once
    # (acct-free is not published again: its repair message waits in the broker)
    result = run_sweep(srt)
    assert result == {
        "result": "ok",
        "stalled": 2,
        "busy": 0,
        "queued": 1,
        "taken_over": 0,
        "reenqueued": ["b-held"],
    }
    assert broker_messages(pw_env) == ["b-free", "b-held"]


def test_a_concurrent_sweep_is_skipped(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the sweeper's lock lasts two intervals: long enough here for the first pass to be
    # seen waiting however slow the machine (the short default is for a dead sweeper)
    monkeypatch.setenv("SWEEPER_INTERVAL", "10")
    runtime.reset()
    srt = runtime.current()
    _save("b-1", "acct-1", srt)
    _age(db_conn)
    guard_key = f"{srt.settings.redis_key_prefix}:sweeper"
    skipped_before = _sweeps("skipped")
    # a table lock holds the first sweep inside its pass (its query waits), for real
    blocker = psycopg.connect(pw_env.database_url)
    results: dict[str, dict[str, Any]] = {}

    def sweep(name: str) -> threading.Thread:
        t = threading.Thread(target=lambda: results.update({name: run_sweep(srt)}))
        t.start()
        return t

    threads = []
    try:
        blocker.execute("LOCK TABLE transactions IN ACCESS EXCLUSIVE MODE")
        threads.append(sweep("first"))

        def first_is_waiting() -> bool:
            row = db_conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()
            return row is not None and row[0] == 1

        wait_until(first_is_waiting, 5, "the first sweep to wait on the table lock")
        assert redis_client.exists(guard_key)
        # in a thread too: a second pass that did not skip would wait on the table, and
        # must fail this test rather than hang it
        threads.append(sweep("second"))
        threads[-1].join(5)
        assert results.get("second") == {
            "result": "skipped",
            "reason": "another sweeper is running",
        }
        assert _sweeps("skipped") == skipped_before + 1
        assert broker_messages(pw_env) == []
    finally:
        blocker.rollback()
        blocker.close()
        for t in threads:
            t.join(10)
    assert results["first"] == {
        "result": "ok",
        "stalled": 1,
        "busy": 0,
        "queued": 0,
        "taken_over": 0,
        "reenqueued": ["b-1"],
    }
    assert broker_messages(pw_env) == ["b-1"]
    # the pass released its lock: the next one runs (and publishes nothing, same period)
    assert not redis_client.exists(guard_key)
    assert run_sweep(srt)["result"] == "ok"


def test_sweeper_never_calls_the_gateway_even_with_items_in_doubt(
    gateway_sim: SimHandle,
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
) -> None:
    assert srt is runtime.current() and srt.settings.gateway_url == gateway_sim.url
    _save("b-1", "acct-1", srt, n=3)
    # a holder that records intent and dies: items left "dispatching", one made "unknown"
    lock = srt.account_lock("acct-1")
    assert lock.acquire()
    with srt.engine.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        assert len(repo.claim_due(conn, "acct-1", lock.fence_token or 0, 10)) == 3
    lock.release()
    db_conn.execute("UPDATE transactions SET status = 'unknown' WHERE transaction_id = 'b-1-0'")
    _age(db_conn)
    before = db_conn.execute(
        "SELECT transaction_id, status, attempts, lookups FROM transactions ORDER BY id"
    ).fetchall()
    assert [r[1] for r in before] == ["unknown", "dispatching", "dispatching"]

    assert run_sweep(srt)["reenqueued"] == ["b-1"]
    assert broker_messages(pw_env) == ["b-1"]
    # nothing reached the gateway: no payment, lookup or token request
    assert gateway_sim.requests("acct-1") == []
    ledger = gateway_sim.ledger()
    assert ledger["payments_sent"] == 0 and ledger["tokens_issued"] == 0
    assert ledger["requests"]["total"] == 0, ledger["requests"]
    # the in-doubt items are left for the next holder to look up, untouched
    after = db_conn.execute(
        "SELECT transaction_id, status, attempts, lookups FROM transactions ORDER BY id"
    ).fetchall()
    assert after == before


SWEEP_CHILD = """
import json
from payment_worker import runtime
from payment_worker.worker.sweeper import run_sweep
print(json.dumps(run_sweep(runtime.current())))
"""


def test_a_failed_publish_leaves_no_marker_so_the_next_sweep_retries(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    redis_client: redis.Redis,
    closed_port: int,
) -> None:
    _save("b-1", "acct-1", srt)
    _age(db_conn)
    # a sweep in a process whose broker refuses connections (a port nobody listens on); in
    # this process Celery's broker is fixed at its first publish, hence the child
    env = {**os.environ, "CELERY_BROKER_URL": f"redis://127.0.0.1:{closed_port}/0"}
    proc = subprocess.run(
        [sys.executable, "-c", SWEEP_CHILD],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "result": "broker_error",
        "stalled": 1,
        "reenqueued": [],
        "taken_over": 0,
    }
    assert redis_client.keys(f"{srt.settings.redis_key_prefix}:swept:*") == []
    # with the broker back, the very next sweep repairs it (no stale period lost)
    assert run_sweep(srt)["reenqueued"] == ["b-1"]
    assert broker_messages(pw_env) == ["b-1"]


def test_a_repair_marker_whose_reply_was_lost_does_not_hold_the_repair_back(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pass's ``SET swept NX`` ran but its reply was lost (a real lost reply: a proxy in
    front of Redis throws it away; the runtime's clients make no retries): the pass fails.
    Before, the marker stayed for SWEEPER_RESEND_AFTER (30 s by default) with no message
    behind it, and every pass meanwhile skipped the account. Now it is dropped, and the next
    pass repairs the account at once (a review found it)."""
    _save("b-1", "acct-1", srt)
    _age(db_conn)
    marker = srt.keys.swept("acct-1")
    direct = srt.redis
    with proxied_redis(pw_env.redis_url, retries=0) as (proxy, client):
        real_set = client.set

        def set_losing_the_markers_reply(name: Any, *args: Any, **kw: Any) -> Any:
            if name == marker:
                proxy.drop_next_reply.set()
            return real_set(name, *args, **kw)

        monkeypatch.setattr(client, "set", set_losing_the_markers_reply)
        monkeypatch.setattr(srt, "redis", client)
        with pytest.raises(redis.exceptions.TimeoutError):
            run_sweep(srt)
        assert not proxy.drop_next_reply.is_set()  # the reply was lost
    assert not redis_client.exists(marker)
    assert broker_messages(pw_env) == []
    monkeypatch.setattr(srt, "redis", direct)
    assert run_sweep(srt)["reenqueued"] == ["b-1"]
    assert broker_messages(pw_env) == ["b-1"]


def test_a_batch_left_processing_with_every_item_terminal_is_completed(
    gateway_sim: SimHandle,
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from payment_worker.db.fences import next_fence_token
    from payment_worker.errors import FencedOut
    from payment_worker.worker import drain

    # the batch's last chunk is recorded, and another holder takes the account over (and
    # "crashes" before doing anything) before the batch is completed, so nobody completes
    # it. A drain now records and completes in one statement (record_and_finish): this is
    # the state a holder of an older release could leave (two statements then)
    monkeypatch.setattr(srt.settings, "process_chunk_size", 3)
    _save("b-full", "acct-1", srt, n=3)
    real_finish = repo.record_and_finish

    def record_then_taken_over(conn: Any, account_id: str, token: int, outcomes: Any) -> Any:
        repo.record_outcomes(conn, account_id, token, outcomes)
        with srt.engine.begin() as other:
            next_fence_token(other, account_id)
        raise FencedOut("taken over between the record and the completion")

    monkeypatch.setattr(repo, "record_and_finish", record_then_taken_over)
    report = drain.run_account("acct-1", "b-full", srt)
    monkeypatch.setattr(repo, "record_and_finish", real_finish)
    assert report.result == "fenced_out"
    # the drain sent every item before it was fenced out (it no longer counts them in its
    # report: the fenced statement that records them raised before the count)
    assert gateway_sim.ledger()["payments_sent"] == 3
    batch = "SELECT status, succeeded_count FROM batches WHERE batch_id = 'b-full'"
    assert db_conn.execute(batch).fetchone() == ("processing", 0)
    statuses = db_conn.execute("SELECT DISTINCT status FROM transactions").fetchall()
    assert statuses == [("succeeded",)]
    # no due item is left: only the sweeper can see it, once nothing was written for a while
    assert run_sweep(srt) == {
        "result": "ok",
        "stalled": 0,
        "busy": 0,
        "queued": 0,
        "taken_over": 0,
        "reenqueued": [],
    }
    _age(db_conn)
    assert run_sweep(srt) == {
        "result": "ok",
        "stalled": 1,
        "busy": 0,
        "queued": 0,
        "taken_over": 0,
        "reenqueued": ["b-full"],
    }
    # it never writes a batch row itself: the holder its message starts completes it
    assert db_conn.execute(batch).fetchone() == ("processing", 0)
    assert broker_messages(pw_env) == ["b-full"]
    assert drain.run_account("acct-1", "b-full", srt).result == "idle"
    assert db_conn.execute(batch).fetchone() == ("completed", 3)
    assert gateway_sim.ledger()["payments_sent"] == 3  # nothing sent again
    # done: the next passes find nothing; a batch with open items is not "uncompleted"
    _save("b-open", "acct-2", srt)
    _age(db_conn)
    with srt.engine.connect() as conn:
        assert stalls.uncompleted_batch_accounts(conn, STALE) == []
        assert [a.batch_id for a in stalls.stalled_accounts(conn, STALE)] == ["b-open"]


def test_an_account_whose_message_waits_behind_a_backlog_is_not_repaired_twice(
    srt: runtime.Runtime, pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """Issue 13: in a burst, items untouched for SWEEPER_STALE_AFTER whose message still waits
    in the broker got a repair message as well (one wasted execution per batch). The
    ``queued`` mark and the age of the oldest waiting message tell waiting from lost."""
    from payment_worker.worker.celery_app import app
    from payment_worker.worker.queueing import ENQUEUED_HEADER, PROCESS_TASK, enqueue_batch
    from payment_worker.worker.sweeper import waited_memory_ms

    for n in ("a", "b", "c"):
        _save(f"b-{n}", f"acct-{n}", srt)
    _age(db_conn)
    now_ms = int(time.time() * 1000)
    # the backlog: a message published 10 s ago still waits at the head of the queue
    app.send_task(
        PROCESS_TASK,
        args=["b-head"],
        queue="payments",
        routing_key="payments",
        headers={ENQUEUED_HEADER: now_ms - 10_000},
    )
    # acct-a's message was published 4 s ago (older than STALE, younger than the backlog),
    # acct-b's just now; acct-c's was never published (the broker was down)
    enqueue_batch("b-a", rt=srt, account_id="acct-a")
    srt.redis.set(srt.keys.queued("acct-a"), now_ms - 4_000)
    enqueue_batch("b-b", rt=srt, account_id="acct-b")
    assert broker_messages(pw_env) == ["b-head", "b-a", "b-b"]
    result = run_sweep(srt)
    assert (result["stalled"], result["queued"], result["reenqueued"]) == (3, 2, ["b-c"])
    # the broker loses every message (a flush): nothing waits, so the mark older than
    # SWEEPER_STALE_AFTER is repaired at once (b-c's repair message was lost too, but its
    # swept marker allows one per SWEEPER_RESEND_AFTER)
    broker = redis.Redis.from_url(pw_env.broker_url)
    broker.delete("payments")
    # a message the last pass saw waiting may have just been taken by a worker whose task
    # has not started: on its way for STALE after that pass (the burst's test below); here
    # that stale period is over
    srt.redis.delete(srt.keys.sweeper_waited())
    assert run_sweep(srt)["reenqueued"] == ["b-a"]
    # messages are taken oldest first: while b-a's repair (published after b-b's message)
    # waits, b-b's message may still be on a worker's way; once the queue has moved on (a
    # worker took b-a's), b-b's is known lost when the pass's memory of b-a's waiting
    # message ends (waited_memory_ms: STALE plus two intervals, 3 s here) at the latest.
    # The wait allows STALE more: with the memory's length alone it raced the key's expiry
    # and failed on a loaded CI host
    result = run_sweep(srt)
    assert (result["queued"], result["reenqueued"]) == (3, [])
    broker.delete("payments")
    memory = waited_memory_ms(srt.settings) / 1000
    wait_until(lambda: "b-b" in run_sweep(srt)["reenqueued"], memory + STALE, "b-b repaired")
    assert "b-b" in broker_messages(pw_env)


def test_a_holder_taking_the_account_clears_its_queued_mark(srt: runtime.Runtime) -> None:
    from payment_worker.worker.queueing import RedisAccountQueue, enqueue_batch

    _save("b-1", "acct-1", srt)
    enqueue_batch("b-1", rt=srt, account_id="acct-1")
    assert srt.redis.get(srt.keys.queued("acct-1")) is not None
    holder = srt.account_lock("acct-1")
    assert holder.acquire(arrival=RedisAccountQueue(srt).arrival("acct-1", "b-1"))
    try:
        assert srt.redis.get(srt.keys.queued("acct-1")) is None
    finally:
        holder.release()


def test_an_account_drained_since_the_sweeps_query_is_not_repaired(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 13: a pass slowed by load read the locks most of a second after its query; an
    account a holder had drained (and released) in between looked free and unmarked and got
    a repair message for nothing. The second look at Postgres finds nothing left."""
    _save("b-done", "acct-done", srt)
    _save("b-open", "acct-open", srt)
    _age(db_conn)
    first_look = stalls.stalled_accounts

    def query_then_holder_drains(*args: Any, **kwargs: Any) -> list[stalls.StalledAccount]:
        found = first_look(*args, **kwargs)
        # right after the query, a holder finishes acct-done and releases its lock
        db_conn.execute(
            "UPDATE transactions SET status = 'succeeded', updated_at = now() - interval '1 min'"
            " WHERE account_id = 'acct-done'"
        )
        return found

    monkeypatch.setattr(stalls, "stalled_accounts", query_then_holder_drains)
    result = run_sweep(srt)
    assert result["stalled"] == 2 and result["reenqueued"] == ["b-open"]
    assert broker_messages(pw_env) == ["b-open"]


def test_an_account_taken_between_the_lock_read_and_the_mark_read_is_busy(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 13: a task that takes the lock right after the sweeper read it free deletes
    the account's queued mark as it does; the mark's read is followed by a second lock read,
    which sees the lock held (under load, about 25 repairs a pass went out without it)."""
    from payment_worker.worker import sweeper
    from payment_worker.worker.queueing import RedisAccountQueue, enqueue_batch

    _save("b-1", "acct-1", srt)
    _age(db_conn)
    enqueue_batch("b-1", rt=srt, account_id="acct-1")
    redis.Redis.from_url(pw_env.broker_url).delete("payments")  # a worker took the message
    holder = srt.account_lock("acct-1")
    first_read = sweeper.read_locks

    def read_then_a_task_starts(*args: Any) -> list[bytes | None]:
        values = first_read(*args)
        # the task takes the lock, and clears the marks in the same script
        assert holder.acquire(arrival=RedisAccountQueue(srt).arrival("acct-1", "b-1"))
        return values

    monkeypatch.setattr(sweeper, "read_locks", read_then_a_task_starts)
    try:
        result = run_sweep(srt)
    finally:
        holder.release()
    assert (result["busy"], result["queued"], result["reenqueued"]) == (1, 0, [])
    assert broker_messages(pw_env) == []


# --- what a pass reads (issue 13: thousands of accounts in flight or waiting) ----------------


def _spy_lock_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The accounts whose lock each pass reads (the real reads still run)."""
    from payment_worker.worker import sweeper

    read: list[str] = []
    real = sweeper.read_locks

    def spy(client: redis.Redis, keys: Any, account_ids: list[str]) -> list[bytes | None]:
        read.extend(account_ids)
        return real(client, keys, account_ids)

    monkeypatch.setattr(sweeper, "read_locks", spy)
    return read


def test_a_holder_is_registered_while_it_beats_and_leaves_when_it_stops(
    srt: runtime.Runtime,
) -> None:
    from payment_worker.locks.liveness import Liveness, dead_holders

    # the thread never beats during the test (start() beats once, the test beats by hand):
    # a beat of its own between the delete and the reads below would register it again
    live = Liveness(srt.redis, srt.keys, ttl_ms=3000, interval_ms=3_600_000, margin_ms=1000)
    live.start()
    try:
        assert srt.redis.zscore(srt.keys.holders(), live.holder_id) is not None
        assert dead_holders(srt.redis, srt.keys, 60_000) == set()
        # its key gone (a killed process's expires): registered, and dead
        srt.redis.delete(live.key)
        assert dead_holders(srt.redis, srt.keys, 60_000) == {live.holder_id}
        # silent for longer than the registry keeps anyone: dropped
        srt.redis.zadd(srt.keys.holders(), {live.holder_id: int(time.time() * 1000) - 61_000})
        assert dead_holders(srt.redis, srt.keys, 60_000) == set()
        assert srt.redis.zscore(srt.keys.holders(), live.holder_id) is None
        live.beat()  # the next beat registers it again
        assert srt.redis.zscore(srt.keys.holders(), live.holder_id) is not None
    finally:
        live.stop()
    assert srt.redis.zscore(srt.keys.holders(), live.holder_id) is None
    assert not srt.redis.exists(live.key)


def test_a_holder_on_a_host_whose_clock_is_behind_is_still_seen_dead(
    srt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry is scored and pruned on the Redis server's clock. Before, each beat wrote
    its host's clock and the sweeper pruned by its own: a worker host ten minutes behind had
    its entry dropped on every pass, and its death went unseen (a review found it)."""
    from payment_worker.locks.liveness import Liveness, dead_holders

    live = Liveness(srt.redis, srt.keys, ttl_ms=3000, interval_ms=3_600_000, margin_ms=1000)
    live.start()
    try:
        real = time.time
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: real() - 600)  # the worker's host
            assert live.beat()
        score = srt.redis.zscore(srt.keys.holders(), live.holder_id)
        seconds, micros = srt.redis.time()
        assert score is not None and abs(score - (seconds * 1000 + micros // 1000)) < 5_000
        srt.redis.delete(live.key)  # it dies
        assert dead_holders(srt.redis, srt.keys, 60_000) == {live.holder_id}
    finally:
        live.stop()


def test_a_pass_with_every_holder_alive_reads_no_lock_of_a_fresh_account(
    srt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 13: each pass read the lock of every account with due work (scenario 5: 2,000
    accounts, 10 Redis reads per item paid). Fresh accounts need no read unless a holder
    died: a live holder's are busy, a free one's message is on its way."""
    read = _spy_lock_reads(monkeypatch)
    for n in range(5):
        _save(f"b-{n}", f"acct-{n}", srt)
    held = srt.account_lock("acct-0")
    assert held.acquire()  # a live, registered holder
    try:
        result = run_sweep(srt)
    finally:
        held.release()
    assert read == [] and result["reenqueued"] == [] and result["stalled"] == 0


def test_a_registered_dead_holders_fresh_account_is_taken_over_at_once(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from payment_worker.locks.liveness import lock_value

    read = _spy_lock_reads(monkeypatch)
    for acct in ("acct-dead", "acct-free"):
        _save(f"b-{acct}", acct, srt)
    # a holder that registered, took the lock and died a moment ago (its key expired)
    redis_client.zadd(srt.keys.holders(), {"ghost-7-dead0001": int(time.time() * 1000)})
    value = lock_value("ghost-7-dead0001", "f" * 32)
    redis_client.set(srt.keys.lock("acct-dead"), value, px=30_000)
    result = run_sweep(srt)
    # every account with due work is read while a registered holder is dead
    assert sorted(read) == ["acct-dead", "acct-free"]
    assert result["taken_over"] == 1 and result["reenqueued"] == ["b-acct-dead"]
    assert broker_messages(pw_env) == ["b-acct-dead"]


def test_behind_a_backlog_a_free_account_is_stale_only_after_the_backlogs_wait(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its message would wait behind the backlog, and so would a repair: an account untouched
    for less than SWEEPER_STALE_AFTER plus the oldest waiting message's age is not read."""
    from payment_worker.worker.celery_app import app
    from payment_worker.worker.queueing import ENQUEUED_HEADER, PROCESS_TASK

    read = _spy_lock_reads(monkeypatch)
    _save("b-lost", "acct-lost", srt)  # its message never left (the broker was down)
    _age(db_conn, 5.0)
    app.send_task(
        PROCESS_TASK,
        args=["b-head"],
        queue="payments",
        routing_key="payments",
        headers={ENQUEUED_HEADER: int(time.time() * 1000) - 10_000},
    )
    result = run_sweep(srt)
    assert read == [] and result["reenqueued"] == []
    # the backlog is gone (a worker took it, or a flush). For STALE after the last pass
    # that saw it waiting its wait still counts (a message just taken may not have
    # started); then 5 s untouched is stale
    redis.Redis.from_url(pw_env.broker_url).delete("payments")
    assert run_sweep(srt)["reenqueued"] == [] and read == []
    wait_until(lambda: run_sweep(srt)["reenqueued"] == ["b-lost"], STALE * 3, "b-lost repaired")
    assert read == ["acct-lost"]


def test_a_burst_taken_by_workers_is_not_repaired_before_its_tasks_take_the_locks(
    srt: runtime.Runtime, pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """Issue 13: a message leaves the queue when a worker takes it, and its task takes the
    account's lock up to a second later while a burst shares the cores. Judged by the queue
    alone, the moment a burst was taken every account of it looked free, stale and unqueued:
    a repair message each (26 to 57 wasted executions in a run of throughput scenario 4).
    What the last pass that found messages waiting saw counts as on its way for
    SWEEPER_STALE_AFTER after it; a message lost after all is repaired then."""
    from payment_worker.worker.celery_app import app
    from payment_worker.worker.queueing import ENQUEUED_HEADER, PROCESS_TASK, RedisAccountQueue

    published = int(time.time() * 1000) - 5_000  # the burst waited 5 s for a worker
    accounts = ["acct-1", "acct-2", "acct-3"]
    for acct in accounts:
        _save(f"b-{acct}", acct, srt)
        srt.redis.set(srt.keys.queued(acct), published)
        app.send_task(
            PROCESS_TASK,
            args=[f"b-{acct}"],
            queue="payments",
            routing_key="payments",
            headers={ENQUEUED_HEADER: published},
        )
    _age(db_conn, 5.0)  # submitted with the burst
    result = run_sweep(srt)  # the burst waits: nothing to repair
    assert (result["stalled"], result["reenqueued"]) == (0, [])
    broker = redis.Redis.from_url(pw_env.broker_url)
    assert broker.delete("payments") == 1  # the workers take the whole burst at once
    result = run_sweep(srt)
    assert result["reenqueued"] == [] and broker_messages(pw_env) == []
    # acct-1's task takes its lock; the worker holding acct-2's and acct-3's dies before
    # their tasks start (their messages come back only after the visibility timeout)
    holder = srt.account_lock("acct-1")
    assert holder.acquire(arrival=RedisAccountQueue(srt).arrival("acct-1", "b-acct-1"))
    try:
        repaired: list[str] = []

        def both_repaired() -> bool:
            repaired.extend(run_sweep(srt)["reenqueued"])
            return {"b-acct-2", "b-acct-3"} <= set(repaired)

        # within the stale period after the pass that saw them waiting, and a pass
        wait_until(both_repaired, STALE * 3, "the lost messages repaired")
        assert sorted(repaired) == ["b-acct-2", "b-acct-3"]
        assert sorted(broker_messages(pw_env)) == ["b-acct-2", "b-acct-3"]
    finally:
        holder.release()


def test_the_memory_of_waited_messages_keeps_the_oldest_for_the_stale_period(
    srt: runtime.Runtime,
) -> None:
    """``_waited_lately``: the older of the queue's oldest and what the last pass that found
    one saw, for SWEEPER_STALE_AFTER and two intervals after it (before, the stale period
    alone: passes further apart never found it); a value it cannot read, or a Redis it cannot
    reach, leaves the queue's own oldest (the rule before it: at worst one repair message too
    many)."""
    from types import SimpleNamespace

    from payment_worker.worker.sweeper import _waited_lately

    key = srt.keys.sweeper_waited()
    srt.redis.delete(key)
    assert _waited_lately(srt, None)[0] is None  # nothing waits, nothing was seen
    assert _waited_lately(srt, 5_000)[0] == 5_000  # kept, for the stale period only
    # for the stale period and two intervals more: the next pass still finds it
    interval = srt.settings.sweeper_interval
    assert STALE * 1000 < srt.redis.pttl(key) <= (STALE + 2 * interval) * 1000
    assert _waited_lately(srt, 9_000)[0] == 5_000  # the queue moved on: the older one counts
    assert _waited_lately(srt, None)[0] == 9_000  # the queue is empty: what the last pass saw
    # the server's time comes with it, from the same round trip
    seconds, micros = srt.redis.time()
    assert abs(_waited_lately(srt, None)[1] - (seconds * 1000 + micros // 1000)) < 1_000
    srt.redis.set(key, "not-a-time")
    assert _waited_lately(srt, 7_000)[0] == 7_000
    # a Redis that cannot be reached (nothing listens on port 1)
    dead = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    unreachable = SimpleNamespace(redis=dead, keys=srt.keys, settings=srt.settings)
    assert _waited_lately(unreachable, 3_000)[0] == 3_000  # type: ignore[arg-type]
    assert _waited_lately(unreachable, None)[0] is None  # type: ignore[arg-type]


def test_a_publishers_skewed_clock_neither_hides_a_lost_message_nor_makes_a_backlog(
    srt: runtime.Runtime,
    pw_env: PwEnv,
    db_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer host whose clock runs an hour ahead publishes a batch, and the message is
    lost (a broker flush): its queued mark was stamped an hour in the future, so the account
    looked "on its way" for an hour. And a message published by a host an hour behind made
    the queue's backlog an hour old, holding every account's repair back that long. The
    stamps and the sweeper's reading of them are now on the Redis server's clock."""
    from payment_worker.worker import queueing, sweeper

    real = time.time

    def publish_at(offset: float, batch_id: str, account: str) -> None:
        data = make_batch(batch_id, account=account, n=2, tx=batch_id)
        with monkeypatch.context() as m:
            m.setattr(queueing.time, "time", lambda: real() + offset)
            assert submit_batch(data, runtime=srt).status == "accepted"

    publish_at(3600.0, "b-ahead", "acct-ahead")
    assert broker_messages(pw_env) == ["b-ahead"]
    redis.Redis.from_url(pw_env.broker_url).delete("payments")  # lost
    _age(db_conn)
    wait_until(
        lambda: run_sweep(srt)["reenqueued"] == ["b-ahead"], STALE * 4, "the lost one repaired"
    )

    redis.Redis.from_url(pw_env.broker_url).delete("payments")
    publish_at(-3600.0, "b-behind", "acct-behind")
    assert broker_messages(pw_env) == ["b-behind"]  # waits: no worker runs here
    assert sweeper._backlog_ms(srt) < 10_000


def test_with_a_dead_holder_the_limit_keeps_the_stale_accounts_first(
    srt: runtime.Runtime, db_conn: psycopg.Connection[Any]
) -> None:
    """While a registered holder is dead the query drops its staleness filter, and its limit
    was filled by the oldest due work: a healthy backlog's, ahead of a stale account whose
    due work is newer (a lost delayed retry), left out until the backlog drained (a review
    found it). Stale accounts come first now."""
    for n in range(3):
        _save(f"b-busy-{n}", f"acct-busy-{n}", srt)
    _save("b-lost", "acct-lost", srt)
    # the backlog's work due long ago and touched just now; the lost retry due just now and
    # untouched for a minute
    db_conn.execute(
        "UPDATE transactions SET next_attempt_at = now() - interval '1 hour', updated_at = now()"
        " WHERE account_id LIKE 'acct-busy-%'"
    )
    db_conn.execute(
        "UPDATE transactions SET next_attempt_at = now() - interval '1 second',"
        " updated_at = now() - interval '1 minute' WHERE account_id = 'acct-lost'"
    )
    with srt.engine.begin() as conn:
        found = stalls.stalled_accounts(conn, STALE, limit=2, every=True)
    assert found[0].account_id == "acct-lost" and found[0].stale
    assert not found[1].stale


def test_a_delayed_retry_due_just_now_counts_as_on_its_way(
    srt: runtime.Runtime, pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """A retry's delayed message comes due with the items; its task may wait a moment for a
    free slot. The account looked free, stale and unmarked, and got a repair message too (a
    review found it). Its ``scheduled`` marker now counts as a message on its way, until it
    expires a few seconds after the due time (a lost delayed message is still repaired)."""
    from payment_worker.worker.queueing import schedule

    _save("b-1", "acct-1", srt)
    _age(db_conn)
    schedule(srt, "acct-1", "b-1", 0.0)  # due now, not taken yet
    broker = redis.Redis.from_url(pw_env.broker_url)
    broker.delete("payments")  # (a countdown of 0 goes to the queue: the test wants it lost)
    result = run_sweep(srt)
    assert (result["queued"], result["reenqueued"]) == (1, [])
    # its marker gone (it expires a few seconds after the due time): repaired
    srt.redis.delete(srt.keys.scheduled("acct-1"))
    assert run_sweep(srt)["reenqueued"] == ["b-1"]


def test_a_delayed_retry_due_later_does_not_hold_back_the_repair_of_due_work(
    srt: runtime.Runtime, pw_env: PwEnv, db_conn: psycopg.Connection[Any]
) -> None:
    """The account waits for a retry a minute from now, and also has work due now whose
    message was lost: that work is repaired at once, not a minute later (the review of the
    fix above found it)."""
    from payment_worker.worker.queueing import schedule

    _save("b-1", "acct-1", srt)
    _age(db_conn)
    schedule(srt, "acct-1", "b-old", 60.0)
    assert run_sweep(srt)["reenqueued"] == ["b-1"]


def test_a_long_pass_keeps_the_waited_memory_past_its_rest(srt: runtime.Runtime) -> None:
    """A pass of P seconds rests the fleet's next one P seconds: the memory of waited
    messages must still be there then (the review of its lengthening found it)."""
    from payment_worker.worker.sweeper import _rest_after, _waited_lately, waited_memory_ms

    srt.redis.delete(srt.keys.sweeper_waited())
    _waited_lately(srt, 5_000)
    _rest_after(srt, 4.0)  # a 4 s pass
    assert srt.redis.pttl(srt.keys.sweeper_waited()) > 4_000 + waited_memory_ms(srt.settings) - 500
