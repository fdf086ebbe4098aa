"""A batch's completion racing a replay or a resolve of one of its items, on a real database.

The completion (db/work.py) counts a batch's items in its statement's snapshot; a replay or a
resolve (db/dead_letters.py) changes one of those items in another transaction. Whichever
commits first, the batch must not end ``completed`` with an open item or with counts that
miss the change. Each test orders the two for real: a third connection holds a row lock that
one of them needs, and the test lets go once the other has committed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import Connection

from payment_worker import runtime
from payment_worker.db import dead_letters as dlq
from payment_worker.db.work import complete_batches
from payment_worker.producer.submit import submit_batch
from tests.conftest import wait_until

ACCT = "acct-race"
TRUST = 3600.0


def _batch_with_a_dead_item(db_conn: psycopg.Connection[Any], batch_id: str) -> int:
    """A batch of two items, one succeeded and one dead with its open dead letter, not yet
    completed, and the account's fence at token 1; returns the dead letter's id."""
    items = [
        {
            "transaction_id": f"{batch_id}-{n}",
            "amount": 1000,
            "currency": "IDR",
            "beneficiary": {"bank_code": "014", "account_number": "1234567890", "name": "B"},
        }
        for n in (1, 2)
    ]
    batch = {"batch_id": batch_id, "account_id": ACCT, "items": items}
    assert submit_batch(batch, runtime=runtime.current()).status == "accepted"
    db_conn.execute(
        "UPDATE transactions SET status = 'succeeded' WHERE transaction_id = %s", (f"{batch_id}-1",)
    )
    db_conn.execute(
        "UPDATE transactions SET status = 'dead', attempts = 8 WHERE transaction_id = %s",
        (f"{batch_id}-2",),
    )
    db_conn.execute("UPDATE batches SET status = 'processing' WHERE batch_id = %s", (batch_id,))
    db_conn.execute(
        "INSERT INTO account_fences (account_id, fence_token) VALUES (%s, 1)"
        " ON CONFLICT (account_id) DO UPDATE SET fence_token = 1",
        (ACCT,),
    )
    row = db_conn.execute(
        "INSERT INTO dead_letters (transaction_pk, batch_pk, reason, attempts, payload)"
        " SELECT id, batch_pk, 'retries_exhausted', 8, '{}' FROM transactions"
        " WHERE transaction_id = %s RETURNING id",
        (f"{batch_id}-2",),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _batch(db_conn: psycopg.Connection[Any], batch_id: str) -> tuple[Any, ...]:
    row = db_conn.execute(
        "SELECT status, completed_at IS NULL, succeeded_count, failed_count, dead_count"
        " FROM batches WHERE batch_id = %s",
        (batch_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def _waiting_on_a_lock(db_conn: psycopg.Connection[Any], pid: int) -> bool:
    row = db_conn.execute(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row is not None and row[0] == "Lock"


def _in_thread(work: Callable[[Connection], Any], rt: runtime.Runtime) -> tuple[Any, Any]:
    """Run ``work`` on an autocommit connection in a thread; returns (thread, results) once
    the connection's backend is known (results[1]: its pid, results[0]: work's answer)."""
    results: dict[int, Any] = {}
    ready = threading.Event()

    def go() -> None:
        with rt.engine.connect() as c:
            c = c.execution_options(isolation_level="AUTOCOMMIT")
            results[1] = c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            ready.set()
            results[0] = work(c)

    thread = threading.Thread(target=go)
    thread.start()
    assert ready.wait(10)
    return thread, results


def _complete(c: Connection) -> list[str]:
    return complete_batches(c, ACCT, 1)


def _complete_around(
    rt: runtime.Runtime, db_conn: psycopg.Connection[Any], meanwhile: Callable[[Connection], Any]
) -> tuple[Any, Any]:
    """The completion takes its snapshot, then waits for the fence row (a third connection
    holds it) while ``meanwhile`` runs and commits; returns both answers, ``meanwhile``'s
    first."""
    with psycopg.connect(str(db_conn.info.dsn)) as holder:
        holder.execute("SELECT 1 FROM account_fences WHERE account_id = %s FOR UPDATE", (ACCT,))
        thread, done = _in_thread(_complete, rt)
        wait_until(lambda: _waiting_on_a_lock(db_conn, done[1]), 10, "the completion to wait")
        with rt.engine.connect() as c:
            answer = meanwhile(c.execution_options(isolation_level="AUTOCOMMIT"))
        holder.rollback()
    thread.join(10)
    return answer, done[0]


def _after_a_completion(
    rt: runtime.Runtime, db_conn: psycopg.Connection[Any], then: Callable[[Connection], Any]
) -> Any:
    """The completion writes, then ``then`` starts and waits for the batch row, then the
    completion commits; returns ``then``'s answer."""
    with rt.engine.connect() as completion:
        assert _complete(completion)  # written, not committed yet
        thread, done = _in_thread(then, rt)
        wait_until(lambda: _waiting_on_a_lock(db_conn, done[1]), 10, "the second to wait")
        completion.commit()
    thread.join(10)
    return done[0]


def test_a_replay_committed_under_a_running_completion_leaves_the_batch_open(
    rt: runtime.Runtime, db_conn: psycopg.Connection[Any]
) -> None:
    """The completion reads the item dead, then the replay commits, then the completion
    writes: it completes nothing, and the batch stays open for its replayed item."""
    dl_id = _batch_with_a_dead_item(db_conn, "race-1")
    replay = _complete_around(rt, db_conn, lambda c: dlq.replay(c, dl_id, TRUST, "t").result)
    assert replay == (dlq.REPLAYED, [])
    assert _batch(db_conn, "race-1")[:2] == ("processing", True)


def test_a_replay_after_an_uncommitted_completion_reopens_the_batch(
    rt: runtime.Runtime, db_conn: psycopg.Connection[Any]
) -> None:
    """The completion writes first and commits while the replay waits for the batch row:
    the replay reopens the batch it completed."""
    dl_id = _batch_with_a_dead_item(db_conn, "race-2")
    replay = _after_a_completion(rt, db_conn, lambda c: dlq.replay(c, dl_id, TRUST, "t").result)
    assert replay == dlq.REPLAYED
    assert _batch(db_conn, "race-2")[:2] == ("processing", True)


def test_a_resolve_committed_under_a_running_completion_is_counted(
    rt: runtime.Runtime, db_conn: psycopg.Connection[Any]
) -> None:
    """The completion reads the item dead, then the resolve commits: the completion writes
    nothing (the batch's next completion counts the resolved item as it is now)."""
    dl_id = _batch_with_a_dead_item(db_conn, "race-3")
    resolve = _complete_around(rt, db_conn, lambda c: dlq.resolve(c, dl_id, "succeeded", "p", "x"))
    assert resolve == (dlq.RESOLVED, [])
    with rt.engine.connect() as c:
        c = c.execution_options(isolation_level="AUTOCOMMIT")
        assert _complete(c) == ["race-3"]
    assert _batch(db_conn, "race-3") == ("completed", False, 2, 0, 0)


def test_a_resolve_after_an_uncommitted_completion_moves_its_counts(
    rt: runtime.Runtime, db_conn: psycopg.Connection[Any]
) -> None:
    dl_id = _batch_with_a_dead_item(db_conn, "race-4")
    resolve = lambda c: dlq.resolve(c, dl_id, "failed", "declined per gateway", "x")  # noqa: E731
    assert _after_a_completion(rt, db_conn, resolve) == dlq.RESOLVED
    assert _batch(db_conn, "race-4") == ("completed", False, 1, 1, 0)
