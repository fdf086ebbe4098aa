"""Every SQL statement of batch processing: claiming work, writing outcomes, completing batches.

Each function is one short statement (its own transaction, autocommit), never held open
across an HTTP call. Every write is fenced (:mod:`payment_worker.db.fences`): it carries the
holder's fencing token and checks it against ``account_fences`` under a share lock (FOR
SHARE) in the same statement, so a writer whose token is older than the account's current
one changes nothing and gets :class:`FencedOut`; a concurrent ``next_fence_token`` waits for
the write to commit, so the order is strict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, text

from payment_worker.db import jsonb
from payment_worker.db.driver import AnyConnection, Statement, fetch
from payment_worker.db.fences import FENCE_CTE, NEXT_FENCE_CTE, execute_fenced, fence_params
from payment_worker.db.models import OPEN_TX_PREDICATE, sql_values
from payment_worker.domain.statuses import (
    IN_DOUBT_TX_STATUSES,
    SENDABLE_TX_STATUSES,
    TERMINAL_TX_STATUSES,
    KeyStatus,
    TxStatus,
)

if TYPE_CHECKING:
    # for the annotation only: at run time the data layer needs no state machine (nor what
    # it imports); outcomes are read by attribute
    from payment_worker.domain.transitions import ItemOutcome


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    """A transaction claimed for one step: to send (``dispatching``) or to look up (``unknown``)."""

    id: int
    batch_pk: int
    account_id: str
    transaction_id: str
    amount: int
    currency: str
    beneficiary: dict[str, Any]
    description: str | None
    idempotency_key: str
    status: TxStatus
    attempts: int
    lookups: int
    request_fingerprint: str | None
    # seconds since the oldest send in doubt (database clock); None when nothing is in doubt
    doubt_age: float | None = None
    # seconds since the first send of it that was ever in doubt, even if a 404 cleared that
    # doubt since (database clock); None when none was
    first_doubt_age: float | None = None
    # its idempotency key's status (``KeyStatus``): "conflict" after a 422 not yet decided
    key_status: str | None = None


class Claim(list[ClaimedItem]):
    """The items one claim took, in batch order, and whether more were due than it took."""

    def __init__(
        self,
        items: Iterable[ClaimedItem] = (),
        *,
        more_due: bool = False,
        fence_token: int | None = None,
    ) -> None:
        super().__init__(items)
        # more items were due (and not locked) than the limit let it take: claim again
        # before completing; False lets the drain end without a second, empty claim
        self.more_due = more_due
        # the fencing token the claim ran under (issued by it, for fence_and_claim)
        self.fence_token = fence_token


# the status lists of the statements below, rendered once
_IN_DOUBT = sql_values(IN_DOUBT_TX_STATUSES)
_SENDABLE = sql_values(SENDABLE_TX_STATUSES)
_TERMINAL = sql_values(TERMINAL_TX_STATUSES)


# Claim up to :n due items of the account in one statement: pending/retryable become
# dispatching (intent recorded before the gateway call, attempts + 1); dispatching left by a
# crashed holder becomes unknown (maybe sent: only a lookup may decide); unknown stays. The
# fence (first) is the holder's current token, or the next one issued by this statement.
def _claim_ctes(skip: str = "") -> str:
    """The claim's CTEs after the fence; ``skip``: more conditions on the due rows."""
    return f"""
due AS (
    SELECT t.id, t.batch_pk, t.status AS prev FROM transactions t
    -- a one-time filter: the fence row is locked before any transaction row
    WHERE EXISTS (SELECT 1 FROM fence)
      AND t.account_id = :acct
      AND t.{OPEN_TX_PREDICATE}
      AND t.next_attempt_at <= now(){skip}
    ORDER BY t.batch_pk, t.id
    -- one row past the limit only tells whether more is due: it is not claimed
    LIMIT :n + 1
    FOR UPDATE OF t SKIP LOCKED
),
pick AS (SELECT id, prev FROM due ORDER BY batch_pk, id LIMIT :n),
claimed AS (
    UPDATE transactions t SET
        status = CASE WHEN pick.prev IN ({_SENDABLE})
                      THEN 'dispatching' ELSE 'unknown' END,
        attempts = t.attempts + CASE WHEN pick.prev IN ({_SENDABLE}) THEN 1 ELSE 0 END,
        -- a crashed holder's send (its dispatched_at, the old value here) is now in doubt.
        -- An item claimed for a lookup may be sent in this step (after a 404): when nothing
        -- of it was in doubt (a replayed item), its doubt dates from this claim, so a record
        -- lost after that send still leaves the in-doubt bound and the key trust a start
        doubt_since = CASE WHEN pick.prev = 'dispatching'
                           THEN COALESCE(t.doubt_since, t.dispatched_at, t.created_at)
                           WHEN pick.prev = 'unknown' THEN COALESCE(t.doubt_since, now())
                           ELSE t.doubt_since END,
        -- the first send ever in doubt, dated for good: a 404 clears doubt_since, but that
        -- send may still land after it (see domain.transitions.too_late_to_send). Every
        -- doubt is claimed for a lookup before one can clear it: the claim dates it, from
        -- the doubt as it was (a replayed item never in doubt stays undated: the date this
        -- claim gives its doubt only stands in for a record that may be lost, and its next
        -- claim dates it if it was)
        first_doubt_at = CASE WHEN pick.prev = 'dispatching'
                              THEN COALESCE(t.first_doubt_at, t.doubt_since, t.dispatched_at,
                                            t.created_at)
                              WHEN pick.prev = 'unknown'
                              THEN COALESCE(t.first_doubt_at, t.doubt_since)
                              ELSE t.first_doubt_at END,
        dispatched_at = now(),
        fence_token = (SELECT fence_token FROM fence),
        updated_at = now()
    FROM pick WHERE t.id = pick.id
    RETURNING t.id, t.batch_pk, t.account_id, t.transaction_id, t.amount, t.currency,
              t.beneficiary, t.description, t.idempotency_key, t.status, t.attempts, t.lookups,
              EXTRACT(EPOCH FROM now() - t.doubt_since)::float8 AS doubt_age,
              EXTRACT(EPOCH FROM now() - t.first_doubt_at)::float8 AS first_doubt_age
),
started AS (
    -- the account's condition bounds the read of batches whatever the statistics (on
    -- statistics that say every batch is completed, the planner read all open batches)
    UPDATE batches b SET status = 'processing', updated_at = now()
    WHERE b.id IN (SELECT batch_pk FROM claimed) AND b.account_id = :acct AND b.status = 'pending'
)"""


# the claim's answer: its rows (one even when nothing was claimed, so the fence verdict
# needs no second query); ``{extra}``: more columns, for a statement that does more
_CLAIM_SELECT = """
SELECT claimed.*, k.request_fingerprint, k.status AS key_status, f.fenced_ok, f.token,
       m.more_due{extra}
FROM (SELECT count(*) AS fenced_ok, max(fence_token) AS token FROM fence) f
CROSS JOIN (SELECT count(*) > :n AS more_due FROM due) m
LEFT JOIN claimed ON true
LEFT JOIN idempotency_keys k ON k.transaction_pk = claimed.id
ORDER BY claimed.batch_pk, claimed.id
"""

_CLAIM = Statement.of(f"WITH {FENCE_CTE},{_claim_ctes()}\n{_CLAIM_SELECT.format(extra='')}")
# the holder's first claim: the fencing token is issued by the claim itself, one round trip
# and one transaction fewer per account than an upsert of its own
_FENCE_AND_CLAIM = Statement.of(
    f"WITH {NEXT_FENCE_CTE},{_claim_ctes()}\n{_CLAIM_SELECT.format(extra='')}"
)


def claim_due(conn: AnyConnection, account_id: str, token: int, limit: int) -> Claim:
    """Claim up to ``limit`` due items of the account (fenced); empty when nothing is due.

    ``more_due`` on the answer says whether more than ``limit`` were due: one statement
    tells the drain both what to send and whether to claim again."""
    rows = execute_fenced(conn, _CLAIM, {"n": limit}, account_id=account_id, token=token)
    return _claim_of(rows, token)


def fence_and_claim(conn: AnyConnection, account_id: str, limit: int) -> Claim:
    """A holder's first claim: issue the account's next fencing token and claim with it, in
    one statement (:data:`~payment_worker.db.fences.NEXT_FENCE_CTE`). The token is the
    answer's ``fence_token``; every later write of the holder carries it. Committed or not
    at all: a retry after a lost answer issues another token (tokens only need to grow), and
    the items the lost claim took are found ``dispatching``, so they are looked up first."""
    rows = fetch(conn, _FENCE_AND_CLAIM, {"n": limit, "acct": account_id})
    return _claim_of(rows, int(rows[0]["token"]))


def _claim_of(rows: Sequence[Mapping[str, Any]], token: int) -> Claim:
    items = [
        ClaimedItem(
            id=r["id"],
            batch_pk=r["batch_pk"],
            account_id=r["account_id"],
            transaction_id=r["transaction_id"],
            amount=r["amount"],
            currency=r["currency"],
            beneficiary=r["beneficiary"],
            description=r["description"],
            idempotency_key=r["idempotency_key"],
            status=TxStatus(r["status"]),
            attempts=r["attempts"],
            lookups=r["lookups"],
            request_fingerprint=r["request_fingerprint"],
            doubt_age=r["doubt_age"],
            first_doubt_age=r["first_doubt_age"],
            key_status=r["key_status"],
        )
        for r in rows
        if r["id"] is not None
    ]
    return Claim(items, more_due=bool(rows and rows[0]["more_due"]), fence_token=token)


# the outcomes' CTEs, shared by _RECORD and _RECORD_AND_FINISH
_RECORD_CTES = f"""
WITH {FENCE_CTE},
v AS (
    SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS v(
        id bigint, status text, attempts int, lookups int, delay float8,
        payment_id text, error_class text, error text, key_status text, dead_reason text,
        doubt text, unsent bool)
),
upd AS (
    UPDATE transactions t SET
        status = v.status, attempts = v.attempts, lookups = v.lookups,
        -- see domain.transitions.Doubt: this step's send dates from its claim
        doubt_since = CASE v.doubt
            WHEN 'since_dispatch' THEN COALESCE(t.doubt_since, t.dispatched_at)
            WHEN 'reset' THEN t.dispatched_at
            WHEN 'clear' THEN NULL
            ELSE t.doubt_since END,
        -- retried in vain since this record or an earlier one (the first step of the item
        -- that reached nothing since one last did); NULL once a request left, and when final
        unsent_since = CASE WHEN v.unsent THEN COALESCE(t.unsent_since, now()) END,
        next_attempt_at = now() + make_interval(secs => v.delay),
        gateway_payment_id = COALESCE(v.payment_id, t.gateway_payment_id),
        last_error_class = v.error_class, last_error = v.error,
        fence_token = :tok, updated_at = now()
    FROM v, fence
    WHERE t.id = v.id AND t.account_id = :acct AND t.status IN ({_IN_DOUBT})
    RETURNING t.id, t.batch_pk, t.status, t.attempts, v.key_status, v.payment_id,
              v.dead_reason, v.error_class, v.error, t.idempotency_key, t.doubt_since,
              t.next_attempt_at
),
keys AS (
    -- written once per step, with the outcome (the transaction row already holds the
    -- intent): final answers, "not_applied", or "sent" while the outcome is unknown; a step
    -- none of whose requests left keeps what the key was (see _outcome_row)
    UPDATE idempotency_keys k SET status = COALESCE(upd.key_status, k.status),
        attempts = upd.attempts,
        result_ref = COALESCE(upd.payment_id, upd.error_class, k.result_ref),
        fence_token = :tok, updated_at = now()
    FROM upd WHERE k.transaction_pk = upd.id
),
dead AS (
    INSERT INTO dead_letters (transaction_pk, batch_pk, reason, error_class, attempts, payload)
    SELECT id, batch_pk, dead_reason, error_class, attempts,
           jsonb_build_object('last_error', error, 'idempotency_key', idempotency_key,
                              'doubt_since', doubt_since)
    FROM upd WHERE status = 'dead'
    ON CONFLICT (transaction_pk) WHERE resolved_at IS NULL AND transaction_pk IS NOT NULL
    -- DLQ hook: a replayed item that dies again updates its open dead letter (the replay
    -- history in the payload is kept)
    DO UPDATE SET reason = EXCLUDED.reason, error_class = EXCLUDED.error_class,
        attempts = EXCLUDED.attempts, payload = dead_letters.payload || EXCLUDED.payload
),
replay_done AS (
    -- DLQ hook: a replayed item that reached succeeded/failed closes its dead letter
    UPDATE dead_letters d SET resolved_at = now(), resolved_by = 'replay',
        resolution_note = 'replay ended ' || upd.status,
        payload = d.payload || jsonb_build_object('replay_result', upd.status)
    FROM upd
    WHERE d.transaction_pk = upd.id AND d.resolved_at IS NULL AND d.replay_count > 0
      AND upd.status IN ('succeeded', 'failed')
      -- the same rows, as an index condition computed once: on statistics that say no
      -- dead letter is open (before an incident's replay), the planner read every open one
      AND d.transaction_pk = ANY (ARRAY(SELECT id FROM upd))
)"""

_RECORD = Statement.of(f"""{_RECORD_CTES}
SELECT (SELECT count(*) FROM upd) AS updated, (SELECT count(*) FROM fence) AS fenced_ok
""")


def _outcome_row(o: ItemOutcome) -> dict[str, Any]:
    # the JSON keys are the columns of the recordset in _RECORD
    d = o.decision
    return {
        "id": o.item_id,
        "status": d.status,
        "attempts": o.attempts,
        "lookups": o.lookups,
        "delay": max(d.delay, 0.0),
        "payment_id": d.payment_id,
        "error_class": d.error_class,
        "error": (d.error[:1000] if d.error else None),
        # no final answer: "sent" (maybe applied) once a request of this step left
        "key_status": d.key_status or (KeyStatus.SENT if o.reached else None),
        "dead_reason": d.dead_reason,
        "doubt": d.doubt,
        "unsent": o.unsent,
    }


def record_outcomes(
    conn: AnyConnection, account_id: str, token: int, outcomes: Sequence[ItemOutcome]
) -> int:
    """Write the outcomes of claimed items in one fenced statement; returns rows changed.

    Terminal states never move back: only rows still ``dispatching``/``unknown`` change.
    Dead items get their dead-letter row in the same statement.
    """
    if not outcomes:
        return 0
    rows = jsonb.dumps([_outcome_row(o) for o in outcomes])
    result = execute_fenced(conn, _RECORD, {"rows": rows}, account_id=account_id, token=token)
    return int(result[0]["updated"])


# a batch's final counts, over rows with batch_pk and status (transactions, or _RECORD_AND_FINISH's
# view of them)
_BATCH_COUNTS = """
    SELECT batch_pk,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'dead') AS dead"""

# The items of the account's open batches, read batch by batch through transactions_batch_idx.
# OFFSET 0 keeps the lateral subquery from being flattened into a join, which the planner,
# on fresh or stale statistics (a table that just grew), has run as a sequential scan of
# every transaction: 30 ms a statement at 10,000 rows, the largest Postgres cost of a drain.
_OPEN_BATCH_ITEMS = """
    SELECT t.id, t.batch_pk, t.status, t.next_attempt_at
    FROM batches ob CROSS JOIN LATERAL (
        SELECT t.id, t.batch_pk, t.status, t.next_attempt_at FROM transactions t
        WHERE t.batch_pk = ob.id OFFSET 0
    ) t
    WHERE ob.account_id = :acct AND ob.status <> 'completed'"""

_COMPLETABLE = f"""{_BATCH_COUNTS}
    FROM ({_OPEN_BATCH_ITEMS}
          AND (CAST(:pks AS bigint[]) IS NULL OR ob.id = ANY(CAST(:pks AS bigint[])))) t
    GROUP BY batch_pk
    HAVING bool_and(status IN ({_TERMINAL}))
"""

# the account's earliest open item's due time (NULL: nothing open); the predicate spelled as
# the partial index's (transactions_open_account_order_idx), so the planner can use it
_NEXT_DUE_AT = f"""
SELECT min(next_attempt_at) FROM transactions t WHERE t.account_id = :acct AND t.{OPEN_TX_PREDICATE}
"""

_COMPLETE_SET = """
UPDATE batches b SET status = 'completed', completed_at = now(), updated_at = now(),
    succeeded_count = s.succeeded, failed_count = s.failed, dead_count = s.dead
"""
# the batches _COMPLETE_SET writes: those of the completable rows ``s``, fenced. The account's
# condition bounds the read of batches whatever the statistics (on statistics that say every
# batch is completed, the planner read all open batches). The last condition holds only
# while the batch row is the version this statement's snapshot read: a replay or a resolve
# of one of its items writes the row, and when that write commits after the snapshot (the
# counts above read the item as dead), Postgres re-checks the conditions on the new version
# and the completion leaves the batch alone (its item's next record, or the sweeper, ends it)
_COMPLETE_WHERE = """WHERE b.id = s.batch_pk AND b.account_id = :acct AND b.status <> 'completed'
      AND EXISTS (SELECT 1 FROM fence)
      AND b.xmin = (SELECT seen.xmin FROM batches seen WHERE seen.id = b.id)"""

_COMPLETE = Statement.of(f"""
WITH {FENCE_CTE}
{_COMPLETE_SET}
FROM ({_COMPLETABLE}) s
{_COMPLETE_WHERE}
RETURNING b.batch_id
""")

# the end of a drain in one statement: complete what is complete, and tell when the next open
# item is due (the UPDATE writes batches only, so the SELECT over transactions is unaffected)
_COMPLETE_AND_NEXT_DUE = Statement.of(f"""
WITH {FENCE_CTE},
done AS (
    {_COMPLETE_SET}
    FROM ({_COMPLETABLE}) s
    {_COMPLETE_WHERE}
    RETURNING b.batch_id
)
SELECT ARRAY(SELECT batch_id FROM done) AS completed, ({_NEXT_DUE_AT}) AS due, now() AS now,
       (SELECT count(*) FROM fence) AS fenced_ok
""")


def complete_batches(
    conn: AnyConnection, account_id: str, token: int, batch_pks: Sequence[int] | None = None
) -> list[str]:
    """Complete the account's batches (all, or those in ``batch_pks``) whose items are all
    terminal; returns their batch ids."""
    pks = None if batch_pks is None else list(batch_pks)
    # fenced like every write: a replaced holder changes nothing (it would only ever complete
    # a batch whose items are all terminal, but the rule has no exceptions). Its stale token
    # is not an error here: the claim and the record around it raise FencedOut
    params = {**fence_params(account_id, token), "pks": pks}
    return [str(r["batch_id"]) for r in fetch(conn, _COMPLETE, params)]


# The last chunk of a drain: its outcomes, the account's batches completed, and the next due
# time, in one statement. Every CTE reads the snapshot taken before the statement, so the
# account's rows are read as they will be: the outcomes' rows as ``upd`` returns them, the
# others as they are (its open rows, and the rest of its batches not yet completed).
_RECORD_AND_FINISH = Statement.of(f"""{_RECORD_CTES},
cur AS (
    SELECT batch_pk, status, next_attempt_at FROM upd
    UNION ALL
    SELECT t.batch_pk, t.status, t.next_attempt_at FROM transactions t
    WHERE t.account_id = :acct AND t.{OPEN_TX_PREDICATE} AND t.id NOT IN (SELECT id FROM upd)
    UNION ALL
    SELECT t.batch_pk, t.status, t.next_attempt_at FROM ({_OPEN_BATCH_ITEMS}) t
    WHERE t.status IN ({_TERMINAL}) AND t.id NOT IN (SELECT id FROM upd)
),
done AS (
    {_COMPLETE_SET}
    FROM ({_BATCH_COUNTS}
        FROM cur
        WHERE batch_pk IN (
            SELECT id FROM batches WHERE account_id = :acct AND status <> 'completed')
        GROUP BY batch_pk
        HAVING bool_and(status IN ({_TERMINAL}))
    ) s
    {_COMPLETE_WHERE}
    RETURNING b.batch_id
)
SELECT (SELECT count(*) FROM upd) AS updated, (SELECT count(*) FROM fence) AS fenced_ok,
       ARRAY(SELECT batch_id FROM done) AS completed,
       (SELECT min(next_attempt_at) FROM cur WHERE status NOT IN ({_TERMINAL})) AS due, now() AS now
""")


def record_and_finish(
    conn: AnyConnection, account_id: str, token: int, outcomes: Sequence[ItemOutcome]
) -> tuple[int, list[str], float | None]:
    """:func:`record_outcomes` and :func:`complete_and_next_due` in one fenced statement, for
    a drain's last chunk: rows changed, batches completed, seconds until the next due item
    (None: nothing open). A stale ``token`` raises FencedOut and writes nothing."""
    rows = jsonb.dumps([_outcome_row(o) for o in outcomes])
    [row] = execute_fenced(
        conn, _RECORD_AND_FINISH, {"rows": rows}, account_id=account_id, token=token
    )
    due: datetime | None = row["due"]
    wait = None if due is None else float((due - row["now"]).total_seconds())
    return int(row["updated"]), [str(b) for b in row["completed"]], wait


# A chunk boundary in one statement: the chunk's outcomes, the batches that ended in it
# (:pks) completed, and the next chunk claimed. Every CTE reads the snapshot taken before the
# statement, where the rows being recorded still read as claimed: the claim skips them (an
# item due again at once is taken by the claim after), and the completion counts them as
# ``upd`` returns them and the rest of those batches as they are.
_RECORDED_AND_DONE = (
    ", (SELECT count(*) FROM upd) AS updated, ARRAY(SELECT batch_id FROM done) AS completed"
)
_RECORD_AND_CLAIM = Statement.of(f"""{_RECORD_CTES},
ended AS (
    SELECT batch_pk, status FROM upd WHERE batch_pk = ANY (CAST(:pks AS bigint[]))
    UNION ALL
    SELECT t.batch_pk, t.status FROM transactions t
    WHERE t.batch_pk = ANY (CAST(:pks AS bigint[])) AND t.account_id = :acct
      AND t.id NOT IN (SELECT id FROM upd)
),
done AS (
    {_COMPLETE_SET}
    FROM ({_BATCH_COUNTS}
        FROM ended GROUP BY batch_pk HAVING bool_and(status IN ({_TERMINAL}))
    ) s
    {_COMPLETE_WHERE}
    RETURNING b.batch_id
),{_claim_ctes(skip=" AND t.id NOT IN (SELECT id FROM v)")}
{_CLAIM_SELECT.format(extra=_RECORDED_AND_DONE)}""")


def record_and_claim(
    conn: AnyConnection,
    account_id: str,
    token: int,
    outcomes: Sequence[ItemOutcome],
    ended: Sequence[int],
    limit: int,
) -> tuple[int, list[str], Claim]:
    """A chunk boundary in one fenced statement: :func:`record_outcomes` (rows changed),
    :func:`complete_batches` of ``ended`` (the batches that ended in the chunk: their ids
    when complete), and :func:`claim_due` of up to ``limit`` items for the next chunk, never
    one of the rows just recorded. A stale ``token`` raises FencedOut and writes nothing."""
    params = {"rows": jsonb.dumps([_outcome_row(o) for o in outcomes]), "pks": list(ended)}
    rows = execute_fenced(
        conn, _RECORD_AND_CLAIM, {**params, "n": limit}, account_id=account_id, token=token
    )
    first = rows[0]
    return int(first["updated"]), [str(b) for b in first["completed"]], _claim_of(rows, token)


def complete_and_next_due(
    conn: AnyConnection, account_id: str, token: int
) -> tuple[list[str], float | None]:
    """As a drain ends, in one statement: :func:`complete_batches` (all of the account's), and
    the seconds until the account's earliest open item is due (<= 0: now; None: nothing
    open). A stale ``token`` raises :class:`~payment_worker.errors.FencedOut`: this is the
    last statement of a drain, so a holder replaced after its last record learns it here."""
    [row] = execute_fenced(
        conn, _COMPLETE_AND_NEXT_DUE, {"pks": None}, account_id=account_id, token=token
    )
    due: datetime | None = row["due"]
    wait = None if due is None else float((due - row["now"]).total_seconds())
    return [str(b) for b in row["completed"]], wait


def account_of_batch(conn: Connection, batch_id: str) -> str | None:
    """The account of a batch, or None when no such batch exists."""
    value = conn.execute(
        text("SELECT account_id FROM batches WHERE batch_id = :b"), {"b": batch_id}
    ).scalar()
    return None if value is None else str(value)


def open_counts(conn: Connection) -> dict[str, int]:
    """Number of transactions per status (all statuses, for tests and tools)."""
    rows = conn.execute(text("SELECT status, count(*) FROM transactions GROUP BY status")).all()
    return {str(r[0]): int(r[1]) for r in rows}
