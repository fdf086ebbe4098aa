"""The drain loop at a chunk boundary (more due than one chunk), on the in-memory fakes: the
chunk's outcomes, the batches that ended in it and the next chunk's claim go in one
statement (``record_and_claim``), unless the slice is over, the worker is stopping or the
lock is gone, when the chunk is only recorded and nothing more is claimed."""

from __future__ import annotations

import pytest

from payment_worker.domain.statuses import TxStatus
from tests.drain_world import ACCT, World


@pytest.fixture
def w() -> World:
    return World.fresh()


def test_a_boundary_records_completes_the_ended_batch_and_claims_in_one_statement(
    w: World,
) -> None:
    w.store.add(ACCT, 1, 3)
    second = w.store.add(ACCT, 2, 4)
    seen: list[tuple[list[int], int]] = []

    def on_call(kind: str, key: str) -> None:
        # as the second chunk's first request leaves: batch 1 is complete already, in the
        # one statement that recorded the first chunk
        if key == second[2].key:
            seen.append((list(w.store.completed), w.store.boundaries))

    w.gateway.on_call = on_call
    report = w.run()
    assert report.items == 7  # type: ignore[attr-defined]
    assert seen == [([1], 1)]
    assert w.store.completed == [1, 2]
    # statements: the first claim, one boundary, the last chunk's record-and-finish
    assert (w.store.claims, w.store.boundaries, w.store.finishes) == (1, 1, 1)
    assert [len(chunk) for chunk in w.store.writes] == [5, 2]


def test_a_slice_over_at_the_boundary_records_the_chunk_and_claims_nothing_more(
    w: World,
) -> None:
    w.max_seconds = 3.0
    w.store.add(ACCT, 1, 3)
    w.store.add(ACCT, 2, 4)
    w.gateway.on_call = lambda kind, key: w.clock.sleep(1.0)  # each request takes 1 s
    report = w.run()
    assert report.handed_off  # type: ignore[attr-defined]
    assert w.queue.handed_off == [(ACCT, "batch-1")]
    assert w.store.boundaries == 0 and w.store.writes and len(w.store.writes[0]) == 5
    # the ended batch is completed on its own; the rest is left pending, not claimed
    assert w.store.completed == [1]
    assert w.store.statuses() == {TxStatus.SUCCEEDED: 5, TxStatus.PENDING: 2}


def test_a_lock_lost_after_the_chunks_last_send_records_it_and_claims_nothing(
    w: World,
) -> None:
    rows = w.store.add(ACCT, 1, 7)

    def on_call(kind: str, key: str) -> None:
        if key == rows[4].key:  # the chunk's last request is on the wire
            w.locks[-1].lost = True

    w.gateway.on_call = on_call
    report = w.run()
    assert report.result == "lock_lost"  # type: ignore[attr-defined]
    assert w.store.boundaries == 0 and [len(c) for c in w.store.writes] == [5]
    assert w.store.statuses() == {TxStatus.SUCCEEDED: 5, TxStatus.PENDING: 2}
    assert all(w.gateway.sends(r.key) == 1 for r in rows[:5])


def test_a_shutdown_during_the_chunks_last_send_claims_nothing_more(w: World) -> None:
    rows = w.store.add(ACCT, 1, 7)

    def on_call(kind: str, key: str) -> None:
        if key == rows[4].key:
            w.stopping[0] = True  # SIGTERM while the chunk's last request is on the wire

    w.gateway.on_call = on_call
    report = w.run()
    assert report.handed_off and report.shutdown  # type: ignore[attr-defined]
    assert w.store.boundaries == 0
    # nothing claimed that the next holder would have to look up first
    assert w.store.statuses() == {TxStatus.SUCCEEDED: 5, TxStatus.PENDING: 2}


def test_a_chunk_claimed_at_a_boundary_is_given_back_untouched_at_a_shutdown(
    w: World,
) -> None:
    """The shutdown comes after the boundary claimed the next chunk: its items are given back
    one by one, untouched and due, so the next holder sends them without a lookup."""
    rows = w.store.add(ACCT, 1, 7)

    def on_call(kind: str, key: str) -> None:
        if key == rows[5].key:
            w.stopping[0] = True

    w.gateway.on_call = on_call
    report = w.run()
    assert report.handed_off and report.shutdown  # type: ignore[attr-defined]
    assert w.store.boundaries == 1
    assert w.store.statuses() == {TxStatus.SUCCEEDED: 6, TxStatus.RETRYABLE: 1}
    # its claimed attempt given back with it, due now, never sent
    assert (rows[6].attempts, rows[6].due_at) == (0, w.clock())
    assert w.gateway.sends(rows[6].key) == 0


def test_a_batch_that_ends_exactly_with_a_chunk_is_completed_at_the_next_boundary(
    w: World,
) -> None:
    """Batch 1 fills the first chunk exactly: the next chunk does not go on with it, so the
    next boundary's statement completes it (before, only the drain's last statement did: a
    backlog behind it kept it ``processing``)."""
    w.store.add(ACCT, 1, 5)
    w.store.add(ACCT, 2, 5)
    third = w.store.add(ACCT, 3, 5)
    seen: list[list[int]] = []

    def on_call(kind: str, key: str) -> None:
        if key == third[0].key:  # the third chunk's first request: two boundaries passed
            seen.append(list(w.store.completed))

    w.gateway.on_call = on_call
    w.run()
    # (batch 2 too ends with its chunk; the third chunk, the last, completes it)
    assert seen == [[1]]
    assert w.store.completed == [1, 2, 3]
    assert (w.store.claims, w.store.boundaries, w.store.finishes) == (1, 2, 1)


def test_a_slice_over_after_a_chunk_that_ends_its_batch_completes_that_batch(
    w: World,
) -> None:
    """The slice ends at a boundary where the chunk's last batch ended with it: no next chunk
    checks that batch in this slice, so the hand-off does."""
    w.max_seconds = 3.0
    w.store.add(ACCT, 1, 5)
    w.store.add(ACCT, 2, 4)
    w.gateway.on_call = lambda kind, key: w.clock.sleep(1.0)  # each request takes 1 s
    report = w.run()
    assert report.handed_off  # type: ignore[attr-defined]
    assert w.store.boundaries == 0 and len(w.store.writes) == 1
    assert w.store.completed == [1]
    assert w.store.statuses() == {TxStatus.SUCCEEDED: 5, TxStatus.PENDING: 4}


def test_due_rows_the_claim_skips_are_waited_for_not_claimed_in_a_busy_loop(
    w: World,
) -> None:
    """A due row another transaction holds locked (an operator's session) is skipped by the
    claim: the holder pauses between claims rather than claiming as fast as it can."""
    w.max_seconds = 2.0
    rows = w.store.add(ACCT, 1, 2)
    w.store.locked.add(rows[1].id)
    claims = w.store.claim_due

    def counted(account_id: str, token: int, limit: int) -> object:
        assert w.store.claims < 100, "claimed in a busy loop"
        return claims(account_id, token, limit)

    w.store.claim_due = counted  # type: ignore[method-assign,assignment]
    w.run()
    assert w.store.statuses() == {TxStatus.SUCCEEDED: 1, TxStatus.PENDING: 1}
    assert w.store.claims <= 2.0 / 0.1 + 1


def test_a_lock_lost_while_the_boundary_claimed_gives_the_new_chunk_back_untouched(
    w: World,
) -> None:
    """The lock goes while the boundary's statement runs (it waited on a row lock, the stall
    bound passed), and the statement still claims the next chunk. Its items were never
    tried: they are given back untouched and due, their claimed attempts with them. Before,
    the loop's own lock check raised first and left them ``dispatching``: the next holder
    looked each up and spent an attempt on it (a review found it)."""
    rows = w.store.add(ACCT, 1, 7)
    claim_at_boundary = w.store.record_and_claim

    def lost_during(*args: object, **kw: object) -> object:
        claimed = claim_at_boundary(*args, **kw)  # type: ignore[arg-type]
        w.locks[-1].lost = True
        return claimed

    w.store.record_and_claim = lost_during  # type: ignore[method-assign]
    report = w.run()
    assert report.result == "lock_lost"  # type: ignore[attr-defined]
    assert w.store.boundaries == 1
    assert w.store.statuses() == {TxStatus.SUCCEEDED: 5, TxStatus.RETRYABLE: 2}
    for row in rows[5:]:
        assert (row.attempts, row.due_at) == (0, w.clock())
        assert w.gateway.sends(row.key) == 0
