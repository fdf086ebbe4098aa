"""The drain loop on in-memory fakes (tests/fakes.py): no Postgres, no Redis, no HTTP.

Each test drives :class:`payment_worker.worker.drain.Drainer` through one path of the state
machine (claim, send, unknown, lookup, backoff, hand-off, lock loss, fencing) and checks what
was sent, what was written and what was put on the queue.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY

from payment_worker.domain.statuses import TxStatus
from payment_worker.gateway.outcomes import Outcome
from payment_worker.locks.arrival import Arrival, EndRider
from tests.drain_world import ACCT, World
from tests.fakes import (
    FakeLock,
    answer,
    ok,
)


@pytest.fixture
def w() -> World:
    return World.fresh()


def test_claim_send_record_and_complete(w: World) -> None:
    rows = w.store.add(ACCT, 1, 3) + w.store.add(ACCT, 2, 4)
    report = w.run()
    assert report.result == "processed" and report.items == 7  # type: ignore[attr-defined]
    assert w.store.statuses() == {"succeeded": 7}
    assert all(w.gateway.sends(r.key) == 1 for r in rows)
    assert w.store.completed == [1, 2]
    # one store for the whole drain; the lock released; no mark left behind
    assert w.store.opened == 1 and w.holders == {} and w.queue.marks == {}


@pytest.mark.parametrize(("items", "claims"), [(5, 1), (10, 2), (12, 3), (3, 1)])
def test_a_claim_that_takes_the_last_due_item_is_not_followed_by_an_empty_one(
    w: World, items: int, claims: int
) -> None:
    """Issue 13: an account whose due items filled its last chunk exactly (20 items, chunks
    of 20) cost one more claim that found nothing; the claim now says whether more is due."""
    w.store.add(ACCT, 1, items)
    report = w.run()
    assert report.items == items  # type: ignore[attr-defined]
    assert w.store.statuses() == {"succeeded": items}
    # chunks of 5: one claim per chunk, none empty; each after the first is claimed in the
    # statement that records the chunk before it
    assert (w.store.claims, w.store.boundaries) == (1, claims - 1)
    assert w.store.finishes == 1 and w.store.completed == [1]


def test_the_holder_gives_its_pacing_back_in_its_locks_release(w: World) -> None:
    w.store.add(ACCT, 1, 3)
    held_then: list[bool] = []
    riders: list[EndRider | None] = []
    account_end = w.gateway.account_end

    def spy(account_id: str) -> EndRider | None:
        held_then.append(account_id in w.holders)
        riders.append(account_end(account_id))
        return riders[-1]

    w.gateway.account_end = spy  # type: ignore[method-assign]
    w.run()
    # once per drain, asked while the lock is held, and sent with its release: the next
    # holder finds the slots given back
    assert w.gateway.done == [ACCT] and held_then == [True] and w.holders == {}
    assert riders[0] is not None
    assert [lock.released_with for lock in w.locks] == [riders]


def test_every_gateway_call_of_a_drain_is_made_as_the_locks_holder(w: World) -> None:
    """The drain tells the client it holds the account's lock (its pacing then goes on past
    a lease without a round trip, docs/gateway.md): true for every send and lookup."""
    [row] = w.store.add(ACCT, 1, 1)
    w.gateway.script[row.key].append(answer(Outcome.UNKNOWN, None, reason="applied"))
    holding: list[bool] = []
    w.gateway.on_call = lambda endpoint, key: holding.append(ACCT in w.holders)
    w.run()
    assert w.gateway.calls == [("create", row.key), ("lookup", row.key)]
    assert w.gateway.held == [True, True] and holding == [True]


def test_an_unknown_outcome_is_looked_up_before_any_resend(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    # the gateway applied the payment but the answer was lost
    w.gateway.script[row.key].append(answer(Outcome.UNKNOWN, None, reason="applied"))
    w.run()
    assert w.gateway.calls == [("create", row.key), ("lookup", row.key)]
    assert row.status is TxStatus.SUCCEEDED and w.gateway.paid[row.key] == 1
    assert (row.attempts, row.lookups) == (1, 1)


def test_a_lookup_that_finds_nothing_sends_again_under_the_same_key(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    # a timeout before the gateway applied anything: the lookup answers 404
    w.gateway.script[row.key].append(answer(Outcome.UNKNOWN, None, reason="timeout"))
    w.run()
    assert w.gateway.calls == [("create", row.key), ("lookup", row.key), ("create", row.key)]
    assert row.status is TxStatus.SUCCEEDED and w.gateway.paid[row.key] == 1
    assert row.attempts == 2


def test_a_crashed_holders_dispatching_items_are_looked_up_not_resent(w: World) -> None:
    [paid, unpaid] = w.store.add(ACCT, 1, 2, status=TxStatus.DISPATCHING, attempts=1)
    w.gateway.paid[paid.key] = 1  # the crashed holder's request went through
    w.run()
    assert w.gateway.sends(paid.key) == 0 and paid.status is TxStatus.SUCCEEDED
    assert w.gateway.calls.count(("lookup", unpaid.key)) == 1
    assert w.gateway.sends(unpaid.key) == 1 and unpaid.status is TxStatus.SUCCEEDED


def test_retry_after_is_the_floor_of_the_next_attempt(w: World) -> None:
    rows = w.store.add(ACCT, 1, 2)
    for r in rows:
        w.gateway.script[r.key].append(answer(Outcome.RETRY, 429, retry_after=30.0))
    start = w.clock()
    w.run()
    # backoff alone is at most 1 s for a first retry: 30 s comes from Retry-After
    assert all(r.status is TxStatus.RETRYABLE and r.due_at >= start + 30.0 for r in rows)
    # longer than HOLD_WAIT_MAX_SECONDS: one delayed message for the account, not one per item
    assert len(w.queue.scheduled) == 1 and w.queue.scheduled[0][2] >= 30.0
    assert w.holders == {}


def test_a_short_wait_is_waited_out_under_the_lock(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.gateway.script[row.key].append(answer(Outcome.RETRY, 429, retry_after=0.5))
    start = w.clock()
    w.run()
    assert row.status is TxStatus.SUCCEEDED and w.gateway.sends(row.key) == 2
    assert w.queue.scheduled == [] and w.clock() - start >= 0.5
    assert len(w.locks) == 1  # one acquisition: the wait happened while holding


def test_retries_exhausted_go_dead_with_a_dead_letter(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.gateway.script[row.key].extend([answer(Outcome.RETRY, 503)] * 3)
    w.hold_wait = 100.0
    w.run()
    assert row.status is TxStatus.DEAD and row.attempts == 3
    assert w.store.dead_letters == [(row.id, "retries_exhausted")]
    assert w.gateway.paid[row.key] == 0


def test_a_row_whose_body_changed_goes_dead_and_is_never_sent(w: World) -> None:
    [changed, fine] = w.store.add(ACCT, 1, 1, fingerprint_ok=False) + w.store.add(ACCT, 1, 1)
    w.run()
    assert changed.status is TxStatus.DEAD and w.gateway.sends(changed.key) == 0
    assert w.store.dead_letters == [(changed.id, "fingerprint_mismatch")]
    assert fine.status is TxStatus.SUCCEEDED


def test_a_lock_lost_mid_chunk_stops_sends_and_writes_what_was_learnt(w: World) -> None:
    rows = w.store.add(ACCT, 1, 5)

    def lose_after_two(kind: str, key: str) -> None:
        if w.gateway.sends(key) and len(w.gateway.calls) == 2:
            w.locks[-1].lost = True  # the watchdog found the lock gone

    w.gateway.on_call = lose_after_two
    report = w.run()
    assert report.result == "lock_lost"  # type: ignore[attr-defined]
    assert len(w.gateway.calls) == 2  # the third guard stopped the third send
    # the two answers were written, and the three items never tried given back untouched
    # (fenced: it lands only while no newer holder exists): due now, their claimed attempt
    # returned, not "dispatching", so the next holder sends them without a lookup
    assert [len(batch) for batch in w.store.writes] == [5]
    assert [r.status for r in rows] == [TxStatus.SUCCEEDED] * 2 + [TxStatus.RETRYABLE] * 3
    assert all(r.attempts == 0 and r.due_at <= w.clock() for r in rows[2:])
    # the next holder pays each once, with no lookup
    w.gateway.on_call = None
    w.run()
    assert w.store.statuses() == {"succeeded": 5}
    assert all(w.gateway.paid[r.key] == 1 for r in rows)
    assert not any(kind == "lookup" for kind, _ in w.gateway.calls)


def test_a_lock_lost_between_two_requests_of_an_item_leaves_that_item_in_doubt(
    w: World,
) -> None:
    """An item in doubt was looked up (404: never arrived) and the lock went before its send:
    a request of that item passed the guard, so it is not given back (it stays in doubt, looked
    up again before any send); only the items after it are."""
    in_doubt = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN, attempts=1)[0]
    rows = w.store.add(ACCT, 1, 2)
    lookup = w.gateway.lookup_payment

    def lookup_then_lose(*args: Any, **kw: Any) -> Any:
        got = lookup(*args, **kw)
        w.locks[-1].lost = True  # the send's guard, next, fails
        return got

    w.gateway.lookup_payment = lookup_then_lose  # type: ignore[method-assign]
    report = w.run()
    assert report.result == "lock_lost"  # type: ignore[attr-defined]
    assert w.gateway.calls == [("lookup", in_doubt.key)]
    assert in_doubt.status is TxStatus.UNKNOWN and in_doubt.attempts == 1
    assert all(r.status is TxStatus.RETRYABLE and r.attempts == 0 for r in rows)


def test_a_lock_lost_before_the_first_send_gives_the_whole_claim_back(w: World) -> None:
    """A holder stalled between its lock check and its first claim (a pause, a wait for a
    pooled connection) and lost its lock meanwhile: its claim landed (the newest token), but
    nothing of it was sent. Given back, the claim spends no attempt and leaves nothing in
    doubt; an item it claimed for a lookup stays in doubt."""
    rows = w.store.add(ACCT, 1, 3)
    in_doubt = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN, attempts=1)[0]
    claim = w.store.fence_and_claim

    def claim_then_lose(*args: Any, **kw: Any) -> Any:
        got = claim(*args, **kw)
        w.locks[-1].lost = True
        return got

    w.store.fence_and_claim = claim_then_lose  # type: ignore[method-assign]
    report = w.run()
    assert report.result == "lock_lost"  # type: ignore[attr-defined]
    assert w.gateway.calls == []
    assert all(r.status is TxStatus.RETRYABLE and r.attempts == 0 for r in rows)
    assert in_doubt.status is TxStatus.UNKNOWN and in_doubt.attempts == 1


def test_a_replaced_holder_writes_nothing_and_counts_one_rejection(w: World) -> None:
    rows = w.store.add(ACCT, 1, 3)

    def taken_over(kind: str, key: str) -> None:
        w.store.fences[ACCT] += 1  # a newer holder got a token: this one is fenced out

    w.gateway.on_call = taken_over
    before = REGISTRY.get_sample_value("payment_worker_fencing_rejections_total") or 0.0
    report = w.run()
    assert report.result == "fenced_out"  # type: ignore[attr-defined]
    assert REGISTRY.get_sample_value("payment_worker_fencing_rejections_total") == before + 1
    assert w.store.writes == [] and all(r.status is TxStatus.DISPATCHING for r in rows)


def test_a_long_drain_hands_the_account_back_after_releasing(w: World) -> None:
    rows = w.store.add(ACCT, 1, 10)
    w.chunk_size, w.max_seconds = 2, 3.0
    w.gateway.on_call = lambda kind, key: w.clock.sleep(1.0)  # each request takes 1 s
    held_at_hand_off: list[bool] = []
    hand_off = w.queue.hand_off

    def record(account_id: str, batch_id: str) -> None:
        held_at_hand_off.append(ACCT in w.holders)
        hand_off(account_id, batch_id)

    w.queue.hand_off = record  # type: ignore[method-assign]
    report = w.run()
    assert report.handed_off and w.queue.handed_off == [(ACCT, "batch-1")]  # type: ignore[attr-defined]
    assert held_at_hand_off == [False]  # released first, so the next task finds it free
    assert 0 < sum(r.status is TxStatus.SUCCEEDED for r in rows) < 10


def test_a_long_drain_that_took_everything_is_not_handed_off(w: World) -> None:
    """Issue 13: a slice that ran past DRAIN_MAX_SECONDS on its last, short chunk sent a
    hand-off message for an account with nothing left: one wasted execution."""
    rows = w.store.add(ACCT, 1, 3)
    w.chunk_size, w.max_seconds = 5, 2.0
    w.gateway.on_call = lambda kind, key: w.clock.sleep(1.0)  # the slice ends mid-chunk
    report = w.run()
    assert not report.handed_off and w.queue.handed_off == []  # type: ignore[attr-defined]
    assert report.result == "processed"  # type: ignore[attr-defined]
    assert all(r.status is TxStatus.SUCCEEDED for r in rows)


def test_a_busy_account_gets_a_mark_and_no_send(w: World) -> None:
    w.store.add(ACCT, 1, 2)
    other = FakeLock(ACCT, w.store, w.holders, w.queue.marks)
    assert other.acquire()
    report = w.run()
    assert report.result == "contended"  # type: ignore[attr-defined]
    assert w.queue.marks == {ACCT: "batch-1"} and w.gateway.calls == []


def _work_arrives_at_release(w: World, arrive: Callable[[], None], times: int) -> None:
    """Before each of the first ``times`` lock releases, ``arrive()``: a batch committed
    after the holder's last claim, whose task found the lock busy and left its mark (only
    the holder's check as it releases sees it then)."""
    left = [times]

    def lock_for(account_id: str) -> FakeLock:
        lock = World.lock_for(w, account_id)
        if left[0] > 0:
            left[0] -= 1
            release = lock.release

            def arrive_then_release(
                arrival: Arrival | None = None, rider: EndRider | None = None
            ) -> bool:
                arrive()
                return release(arrival, rider)

            lock.release = arrive_then_release  # type: ignore[method-assign]
        return lock

    w.lock_for = lock_for  # type: ignore[method-assign]


def test_the_holder_rechecks_the_mark_after_releasing_and_drains_again(w: World) -> None:
    w.store.add(ACCT, 1, 2)
    late: list[object] = []

    def arrive() -> None:
        late.extend(w.store.add(ACCT, 2, 3))
        w.queue.announce(ACCT, "batch-2")

    _work_arrives_at_release(w, arrive, times=1)
    w.run()
    assert len(w.locks) == 2  # drained, released, saw the mark, drained again
    assert w.store.statuses() == {"succeeded": 5} and len(late) == 3
    assert w.queue.marks == {}


# --- in doubt: patience in time, the gateway's memory, answers read as the protocol says ---


def test_a_key_in_flight_is_waited_out_and_paid_once(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.hold_wait = 100.0
    # 409 to the create, then 409 to every lookup for a long while, then the stored 201
    w.gateway.script[row.key].append(answer(Outcome.UNKNOWN, 409, reason="in_flight"))
    w.gateway.lookup_script[row.key].extend([answer(Outcome.IN_FLIGHT, 409)] * 40)
    w.gateway.lookup_script[row.key].append(ok("p-late"))
    w.run_until_settled()
    assert (row.status, row.payment_id) == (TxStatus.SUCCEEDED, "p-late")
    assert w.gateway.sends(row.key) == 1 and w.store.dead_letters == []
    assert row.lookups == 41 and row.attempts == 1


def test_an_item_in_doubt_goes_dead_after_the_bound_not_after_a_count(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.hold_wait, w.in_doubt_max = 100.0, 120.0
    w.gateway.script[row.key].append(answer(Outcome.UNKNOWN, None, reason="timeout"))
    # the gateway is down for good: every lookup 503, some never even leave
    w.gateway.lookup_script[row.key].extend(
        [answer(Outcome.RETRY, 503), answer(Outcome.RETRY, None, sent=False)] * 500
    )
    start = w.clock()
    w.run_until_settled()
    assert (row.status, w.store.dead_letters) == (TxStatus.DEAD, [(row.id, "unknown_unresolved")])
    assert w.clock() - start >= 120.0 and w.gateway.sends(row.key) == 1
    # only the lookups that reached the gateway were counted
    looked = sum(1 for kind, _ in w.gateway.calls if kind == "lookup")
    assert 0 < row.lookups < looked


def test_a_404_after_the_gateway_may_have_forgotten_the_key_never_sends(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN, attempts=1)
    row.doubt_since = w.clock() - 80_000.0  # in doubt since longer than the retention trust
    w.run()
    assert w.gateway.calls == [("lookup", row.key)]
    assert (row.status, w.store.dead_letters) == (TxStatus.DEAD, [(row.id, "in_doubt_key_expired")])


def test_a_404_within_the_retention_clears_the_doubt_and_sends_again(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN, attempts=1)
    row.doubt_since = w.clock() - 70_000.0
    w.run()
    assert w.gateway.calls == [("lookup", row.key), ("create", row.key)]
    assert row.status is TxStatus.SUCCEEDED and row.doubt_since is None


def test_a_resend_after_a_404_that_is_lost_again_is_in_doubt_from_that_step(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN, attempts=1)
    row.doubt_since = w.clock() - 70_000.0
    w.gateway.script[row.key].append(answer(Outcome.UNKNOWN, None, reason="timeout"))
    w.hold_wait = 0.0  # stop after the step, to look at the row
    w.run()
    assert row.status is TxStatus.UNKNOWN
    # the old doubt was cleared by the 404; the new one dates from this step's claim
    assert row.doubt_since == row.dispatched_at and w.clock() - row.doubt_since < 1.0


def test_a_send_once_in_doubt_past_the_key_trust_is_never_followed_by_another(
    w: World,
) -> None:
    """A 404 cleared the item's doubt and it was sent again, in vain (refused); but the send
    that was in doubt may have landed after that 404, and the gateway may have forgotten its
    key since: the next send could pay a second time. A person decides, nothing is sent."""
    [row] = w.store.add(ACCT, 1, 1, status=TxStatus.RETRYABLE, attempts=2)
    row.first_doubt_at = w.clock() - 80_000.0
    w.run()
    assert w.gateway.calls == []
    assert (row.status, w.store.dead_letters) == (TxStatus.DEAD, [(row.id, "in_doubt_key_expired")])
    assert row.attempts == 2


def test_a_404_within_the_trust_of_the_last_doubt_but_not_of_the_first_never_sends(
    w: World,
) -> None:
    [row] = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN, attempts=2)
    row.doubt_since, row.first_doubt_at = w.clock() - 70_000.0, w.clock() - 80_000.0
    w.run()
    assert w.gateway.calls == [("lookup", row.key)]
    assert (row.status, w.store.dead_letters) == (TxStatus.DEAD, [(row.id, "in_doubt_key_expired")])


def test_a_404_after_a_422_whose_lookup_got_no_answer_is_a_key_conflict(w: World) -> None:
    """The gateway held another body under the item's key (422); the lookup right after got
    no answer, so the item was only in doubt. When the gateway then forgot the key, the 404
    was read as "never applied" and the item sent: what the gateway held may have been a
    payment of this very transaction (a review found it). Now a person decides."""
    [row] = w.store.add(ACCT, 1, 1)
    w.gateway.script[row.key].append(answer(Outcome.CONFLICT, 422))
    w.gateway.lookup_script[row.key].extend(
        [answer(Outcome.RETRY, 503), answer(Outcome.NOT_FOUND, 404)]
    )
    w.hold_wait = 0.0  # stop after the step, to look at the row
    w.run()
    assert (row.status, row.key_status) == (TxStatus.UNKNOWN, "conflict")
    w.run_until_settled()
    assert (row.status, w.store.dead_letters) == (TxStatus.DEAD, [(row.id, "key_conflict")])
    assert w.gateway.sends(row.key) == 1


def test_a_replayed_item_never_in_doubt_is_not_made_once_in_doubt_by_its_claim(
    w: World,
) -> None:
    """A replayed item whose sends were all answered "not applied": its claim dates its
    doubt (a stand-in for a record that may be lost), and its lookup's 404 sends it, again
    answered 503. Before, the claim's date became its first doubt for good, and a long
    outage then made it die, and its replay be refused, as past the key trust (a review
    found it)."""
    [row] = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN)  # as a replay leaves it
    w.max_attempts = 100
    w.gateway.script[row.key].append(answer(Outcome.RETRY, 503))
    w.hold_wait = 0.0
    w.run()
    assert w.gateway.calls == [("lookup", row.key), ("create", row.key)]
    assert row.status is TxStatus.RETRYABLE and row.first_doubt_at is None
    w.clock.sleep(200_000.0)
    w.run()
    assert row.status is TxStatus.SUCCEEDED and w.store.dead_letters == []


def test_sends_that_were_never_in_doubt_are_sent_again_whenever(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.max_attempts = 100
    w.gateway.script[row.key].extend([answer(Outcome.RETRY, 503)] * 3)
    w.hold_wait = 0.0
    w.run()
    assert row.status is TxStatus.RETRYABLE and row.doubt_since is None
    w.clock.sleep(200_000.0)  # far past any retention: nothing of it was ever in doubt
    while row.status is TxStatus.RETRYABLE:
        w.clock.sleep(10.0)
        w.run()
    assert row.status is TxStatus.SUCCEEDED and w.gateway.sends(row.key) == 4


def test_requests_that_never_left_use_up_no_attempt(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.hold_wait = 100.0
    # a token endpoint failing for a while: more failures than RETRY_MAX_ATTEMPTS
    w.gateway.script[row.key].extend([answer(Outcome.RETRY, None, sent=False)] * 10)
    w.run()
    assert row.status is TxStatus.SUCCEEDED and w.store.dead_letters == []
    assert row.attempts == 1  # only the request that reached the gateway


def test_a_422_is_looked_up_and_a_matching_stored_payment_is_ours(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.gateway.script[row.key].append(answer(Outcome.CONFLICT, 422))
    stored = {"transaction_id": row.transaction_id, "amount": row.amount, "currency": "IDR"}
    w.gateway.lookup_script[row.key].append(
        answer(Outcome.SUCCEEDED, 200, payment_id="p-stored", stored=stored)
    )
    w.run()
    assert (row.status, row.payment_id) == (TxStatus.SUCCEEDED, "p-stored")
    assert w.gateway.calls == [("create", row.key), ("lookup", row.key)]


def test_a_422_for_something_else_is_a_key_conflict_never_failed(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.gateway.script[row.key].append(answer(Outcome.CONFLICT, 422))
    stored = {"transaction_id": "someone-else", "amount": 1, "currency": "IDR"}
    w.gateway.lookup_script[row.key].append(
        answer(Outcome.SUCCEEDED, 200, payment_id="p-x", stored=stored)
    )
    w.run()
    assert (row.status, w.store.dead_letters) == (TxStatus.DEAD, [(row.id, "key_conflict")])
    assert w.gateway.sends(row.key) == 1


def test_an_html_200_is_looked_up_not_believed(w: World) -> None:
    [row] = w.store.add(ACCT, 1, 1)
    w.gateway.script[row.key].append(answer(Outcome.UNKNOWN, 200, reason="applied"))
    w.run()
    assert w.gateway.calls == [("create", row.key), ("lookup", row.key)]
    assert row.status is TxStatus.SUCCEEDED and w.gateway.paid[row.key] == 1


def test_the_holder_reports_progress_between_any_two_steps(w: World) -> None:
    # every step takes time: a claim 0.3 s, a request 1 s, a record 0.5 s
    # in doubt: a lookup (404) then a send each, two requests per item
    w.store.add(ACCT, 1, 5, status=TxStatus.UNKNOWN, attempts=1)
    w.store.add(ACCT, 2, 4)
    w.chunk_size = 3
    for name, seconds in (("claim_due", 0.3), ("record_outcomes", 0.5)):
        real = getattr(w.store, name)

        def slow(*args: object, _real: Any = real, _s: float = seconds) -> Any:
            w.clock.sleep(_s)
            return _real(*args)

        setattr(w.store, name, slow)
    w.gateway.on_call = lambda kind, key: w.clock.sleep(1.0)
    start = w.clock()
    w.run()
    assert w.store.statuses() == {"succeeded": 9} and len(w.gateway.calls) == 14
    [lock] = w.locks
    reports = [start, *lock.progress_at, w.clock()]
    # the longest silence is one step: never a whole item, let alone a chunk
    assert max(b - a for a, b in itertools.pairwise(reports)) <= 1.0


def test_a_warm_shutdown_hands_the_account_back_between_two_items(w: World) -> None:
    rows = w.store.add(ACCT, 1, 5)
    in_doubt = w.store.add(ACCT, 1, 1, status=TxStatus.UNKNOWN, attempts=1)[0]
    w.gateway.paid[in_doubt.key] = 1

    def shutdown_after_two(kind: str, key: str) -> None:
        if len(w.gateway.calls) == 2:
            w.stopping[0] = True  # SIGTERM arrives while the second request is on the wire

    w.gateway.on_call = shutdown_after_two
    report = w.run()
    # the two items sent were recorded; nothing else was sent
    assert len(w.gateway.calls) == 2
    assert [r.status for r in rows[:2]] == [TxStatus.SUCCEEDED] * 2
    # the untouched items are given back due now, attempt returned, never "dispatching"
    # (the next holder sends them without a lookup); the in-doubt one stays in doubt
    assert all(r.status is TxStatus.RETRYABLE and r.attempts == 0 for r in rows[2:])
    assert all(r.due_at <= w.clock() for r in rows[2:])
    assert in_doubt.status is TxStatus.UNKNOWN and in_doubt.attempts == 1
    # released first, then re-enqueued at once
    assert report.handed_off and report.shutdown  # type: ignore[attr-defined]
    assert w.queue.handed_off == [(ACCT, "batch-1")] and w.holders == {}
    # the next holder (another worker) finishes the account; each paid once
    w.stopping[0] = False
    w.run()
    assert w.store.statuses() == {"succeeded": 6}
    assert all(w.gateway.paid[r.key] == 1 for r in [*rows, in_doubt])


def test_a_drain_that_starts_during_shutdown_hands_back_at_once(w: World) -> None:
    w.store.add(ACCT, 1, 3)
    w.stopping[0] = True
    report = w.run()
    assert w.gateway.calls == [] and report.handed_off  # type: ignore[attr-defined]
    assert w.queue.handed_off == [(ACCT, "batch-1")] and w.holders == {}


def test_a_give_back_refused_by_a_newer_holder_is_not_counted_as_a_rejection(
    w: World,
) -> None:
    """The lock went and another holder took the account (a newer token) before this one's
    first send: its give-back is fenced out, as it should be. That is the lock loss, reported
    once as such, not a fencing rejection besides (no second alert for one stall)."""
    rows = w.store.add(ACCT, 1, 3)
    claim = w.store.fence_and_claim

    def claim_then_be_replaced(*args: Any, **kw: Any) -> Any:
        got = claim(*args, **kw)
        w.locks[-1].lost = True
        w.store.fences[ACCT] += 1  # the newer holder's token
        return got

    w.store.fence_and_claim = claim_then_be_replaced  # type: ignore[method-assign]
    before = REGISTRY.get_sample_value("payment_worker_fencing_rejections_total") or 0.0
    report = w.run()
    assert report.result == "lock_lost"  # type: ignore[attr-defined]
    assert REGISTRY.get_sample_value("payment_worker_fencing_rejections_total") == before
    assert w.gateway.calls == [] and w.store.writes == []
    assert all(r.status is TxStatus.DISPATCHING for r in rows)  # the newer holder's to look up


def test_work_that_keeps_arriving_is_handed_back_after_a_slice_not_drained_for_ever(
    w: World,
) -> None:
    """Each drain ends before the next batch arrives, whose task leaves its mark: the holder
    drains again, but after ``DRAIN_MAX_SECONDS`` in all the account goes back to the queue
    (before, one task drained it for as long as batches kept coming)."""
    w.max_seconds = 3.0
    w.store.add(ACCT, 1, 1)
    w.gateway.on_call = lambda kind, key: w.clock.sleep(1.0)  # each request takes 1 s
    batches = iter(range(2, 100))

    def arrive() -> None:
        n = next(batches)
        w.store.add(ACCT, n, 1)
        w.queue.announce(ACCT, f"batch-{n}")

    _work_arrives_at_release(w, arrive, times=100)
    report = w.run()
    assert report.handed_off  # type: ignore[attr-defined]
    assert w.queue.handed_off == [(ACCT, "batch-1")]
    assert len(w.locks) == 3  # three drains of 1 s each: the slice is over
    assert w.store.statuses() == {"succeeded": 3, "pending": 1}
