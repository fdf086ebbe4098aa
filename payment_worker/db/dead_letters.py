"""Every SQL statement of the dead-letter tooling (``dlq list|show|replay|resolve``) and of the
``task_crashed`` hook.

A dead letter's *state*, as on-call filters it:

- ``open``: not resolved, and its transaction is ``dead`` (or it has no transaction: a
  ``task_crashed`` row): a person has to decide.
- ``replayed``: replayed at least once (whatever happened since).
- ``resolved``: closed, by hand (``dlq resolve``) or because a replayed transaction reached
  ``succeeded``/``failed`` (``resolved_by = 'replay'``, written by the worker's record
  statement in :mod:`payment_worker.db.work`).

Replay and resolve are each ONE conditional statement per item: they change a transaction
only while it is ``dead`` and its open dead letter is the one named, so they can never move a
row that is not dead, and of two concurrent calls on one item exactly one wins (the loser's
UPDATE waits for the winner's row lock, re-checks ``status = 'dead'`` and changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from payment_worker.db import jsonb

TASK_CRASHED = "task_crashed"

# The reasons a replay may act on. key_conflict is never replayed: the gateway holds another
# request under the key, and the lookup a replay starts with would record that payment as
# ours. fingerprint_mismatch would only die again (the row no longer matches what was
# accepted). in_doubt_key_expired is refused as "key retention passed" whatever its age reads:
# it died because it was older than the trust, and a tool run with a longer
# GATEWAY_KEY_RETENTION_SECONDS than the workers' must not send it to a worker that refuses.
REPLAYABLE_REASONS = ("retries_exhausted", "unknown_unresolved")
_REPLAYABLE = ", ".join(f"'{r}'" for r in REPLAYABLE_REASONS)

# Since when the sends of a dead item ``t`` count as in doubt for the key trust. A 404 within
# the trust clears doubt_since and the item goes on under its key; if it then died (attempts
# used up), its row reads "never in doubt" though it was, and a send of it may still have
# been applied (a paused holder's that left late) and be forgotten by the gateway past its
# retention. So its first send ever in doubt counts (first_doubt_at, kept since migration
# 0009, which dated the items there were: one ever looked up from its creation, never from a
# later doubt). A lookup alone proves nothing since (a replay's lookup is not a doubt), so an
# item whose sends were all answered "not applied" replays at any age, again and again.
# doubt_since only for the moment a claim's stand-in date has not been recorded yet.
DOUBT_SINCE = "COALESCE(t.first_doubt_at, t.doubt_since)"

# how a dead letter's state is computed (see the module docstring); ``t`` is its transaction
_STATE = """CASE WHEN d.resolved_at IS NOT NULL THEN 'resolved'
     WHEN d.transaction_pk IS NULL OR t.status = 'dead' THEN 'open'
     ELSE 'replayed' END"""

_STATE_FILTER = {
    "open": "d.resolved_at IS NULL AND (d.transaction_pk IS NULL OR t.status = 'dead')",
    "replayed": "d.replay_count > 0",
    "resolved": "d.resolved_at IS NOT NULL",
    "all": "true",
}
STATES = tuple(_STATE_FILTER)

_SELECT = f"""
SELECT d.id, d.reason, d.error_class, d.attempts AS dl_attempts, d.payload, d.created_at,
       d.replay_count, d.replayed_at, d.resolved_at, d.resolved_by, d.resolution_note,
       d.transaction_pk, d.batch_pk,
       EXTRACT(EPOCH FROM now() - d.created_at)::float8 AS age,
       {_STATE} AS state,
       t.account_id, t.transaction_id, t.status AS tx_status, t.attempts, t.lookups,
       t.amount, t.currency, t.beneficiary, t.idempotency_key, t.last_error_class,
       t.last_error, t.gateway_payment_id, {DOUBT_SINCE} AS doubt_since, t.next_attempt_at,
       EXTRACT(EPOCH FROM now() - {DOUBT_SINCE})::float8 AS doubt_age,
       b.batch_id, b.status AS batch_status, b.account_id AS batch_account_id,
       k.status AS key_status, k.result_ref AS key_result_ref, k.attempts AS key_attempts,
       k.updated_at AS key_updated_at
FROM dead_letters d
LEFT JOIN transactions t ON t.id = d.transaction_pk
LEFT JOIN batches b ON b.id = COALESCE(t.batch_pk, d.batch_pk)
LEFT JOIN idempotency_keys k ON k.transaction_pk = t.id
"""

_LIST_WHERE = """
  AND (CAST(:reason AS text) IS NULL OR d.reason = :reason)
  AND (CAST(:acct AS text) IS NULL
       OR COALESCE(t.account_id, b.account_id, d.payload->>'account_id') = :acct)
  AND (CAST(:since AS double precision) IS NULL
       OR GREATEST(d.created_at, CASE WHEN t.status = 'dead' THEN t.updated_at END)
          >= now() - make_interval(secs => CAST(:since AS double precision)))
"""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead letter with what is known of its transaction, batch and key."""

    row: dict[str, Any]

    @property
    def id(self) -> int:
        """The dead letter's id."""
        return int(self.row["id"])

    @property
    def reason(self) -> str:
        """Why it is dead."""
        return str(self.row["reason"])

    @property
    def state(self) -> str:
        """open, replayed or resolved."""
        return str(self.row["state"])


def list_dead_letters(
    conn: Connection,
    *,
    state: str = "open",
    reason: str | None = None,
    account_id: str | None = None,
    since_seconds: float | None = None,
) -> list[DeadLetter]:
    """Dead letters matching the filters, oldest first."""
    if state not in _STATE_FILTER:
        raise ValueError(f"unknown state {state!r}")
    sql = text(f"{_SELECT} WHERE {_STATE_FILTER[state]} {_LIST_WHERE} ORDER BY d.id")
    params = {"reason": reason, "acct": account_id, "since": since_seconds}
    return [DeadLetter(dict(r)) for r in conn.execute(sql, params).mappings()]


def get_dead_letter(conn: Connection, dead_letter_id: int) -> DeadLetter | None:
    """One dead letter (any state), or None."""
    row = conn.execute(text(f"{_SELECT} WHERE d.id = :id"), {"id": dead_letter_id}).mappings()
    first = row.first()
    return None if first is None else DeadLetter(dict(first))


def known_reasons(conn: Connection) -> set[str]:
    """Every reason that some dead letter carries (to tell a typo from an empty result)."""
    return {str(r) for r in conn.execute(text("SELECT DISTINCT reason FROM dead_letters"))}


# ---- replay ----------------------------------------------------------------------------------

# One statement: the transaction goes back from dead to unknown (looked up first under its
# original key by the next holder, sent again only on a 404 within the key trust), due now,
# with a fresh attempt budget, its doubt dated as DOUBT_SINCE says (its unsent_since cleared:
# a replay is a fresh start, not a stall); the dead letter counts the replay; a
# completed batch is reopened so that its counts are written again when it completes.
# Nothing changes unless the transaction is still dead, this dead letter is its open one, and
# no send of it has been in doubt for longer than the key trust.
_REPLAY = text(f"""
WITH tx AS (
    UPDATE transactions t SET status = 'unknown', attempts = 0, next_attempt_at = now(),
        unsent_since = NULL, doubt_since = {DOUBT_SINCE}, updated_at = now()
    FROM dead_letters d
    WHERE d.id = :id AND d.transaction_pk = t.id AND d.resolved_at IS NULL
      AND t.status = 'dead' AND d.reason IN ({_REPLAYABLE})
      AND ({DOUBT_SINCE} IS NULL OR {DOUBT_SINCE} > now() - make_interval(secs => :trust))
    RETURNING t.id, t.batch_pk, t.account_id
),
dl AS (
    UPDATE dead_letters d SET replay_count = d.replay_count + 1, replayed_at = now(),
        payload = d.payload || jsonb_build_object('replays',
            COALESCE(d.payload->'replays', '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                'at', now(), 'by', CAST(:by AS text), 'reason', d.reason,
                'result', 'back to unknown: look up first, send only if never applied')))
    FROM tx WHERE d.id = :id
    RETURNING d.id
),
reopened AS (
    -- the batch row is written whatever its status, so a completion running meanwhile either
    -- wrote it first (this write waits for it and reopens what it completed) or completes
    -- nothing (the row changed under it: db.work's _COMPLETE_WHERE)
    UPDATE batches b SET
        status = CASE WHEN b.status = 'completed' THEN 'processing' ELSE b.status END,
        completed_at = CASE WHEN b.status = 'completed' THEN NULL ELSE b.completed_at END,
        updated_at = now()
    FROM tx WHERE b.id = tx.batch_pk
)
SELECT tx.id, tx.account_id, b.batch_id FROM tx JOIN batches b ON b.id = tx.batch_pk
""")

# why a replay changed nothing (read after the fact, only to explain it)
_WHY_NOT = text(f"""
SELECT d.resolved_at IS NOT NULL AS resolved, d.transaction_pk IS NULL AS no_tx,
       d.reason, t.status, {DOUBT_SINCE} IS NOT NULL
                 AND {DOUBT_SINCE} <= now() - make_interval(secs => :trust) AS expired
FROM dead_letters d LEFT JOIN transactions t ON t.id = d.transaction_pk
WHERE d.id = :id
""")

# what `dlq replay` reports per item
REPLAYED = "replayed"
NOT_FOUND = "not_found"
NOT_DEAD = "not_dead"  # resolved, or no longer dead (replayed, or finished)
KEY_EXPIRED = "key_expired"
NO_TRANSACTION = "no_transaction"
NOT_REPLAYABLE = "not_replayable"

WILL_NOT_RESEND = "will not resend: key retention passed, resolve by hand"
LOOK_UP_FIRST = "look up, then send if the gateway never applied it"


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What replaying one dead letter did."""

    dead_letter_id: int
    result: str  # REPLAYED, NOT_FOUND, NOT_DEAD, KEY_EXPIRED, NOT_REPLAYABLE, NO_TRANSACTION
    account_id: str | None = None
    batch_id: str | None = None
    detail: str = ""


def replay_refusal(
    conn: Connection, dead_letter_id: int, key_trust_seconds: float
) -> ReplayResult | None:
    """Why replaying this dead letter would change nothing now, or None if it would replay."""
    row = conn.execute(_WHY_NOT, {"id": dead_letter_id, "trust": key_trust_seconds}).first()
    if row is None:
        return ReplayResult(dead_letter_id, NOT_FOUND, detail="no such dead letter")
    if row.no_tx:
        return ReplayResult(
            dead_letter_id,
            NO_TRANSACTION,
            detail="no transaction to replay (a crashed task): resolve by hand",
        )
    if row.resolved:
        return ReplayResult(dead_letter_id, NOT_DEAD, detail="already resolved")
    if row.status != "dead":
        return ReplayResult(dead_letter_id, NOT_DEAD, detail=f"no longer dead ({row.status})")
    if row.reason == "in_doubt_key_expired":
        return ReplayResult(dead_letter_id, KEY_EXPIRED, detail=WILL_NOT_RESEND)
    if row.reason not in REPLAYABLE_REASONS:
        why = (
            "the gateway holds another request under this key, a lookup would take it for ours"
            if row.reason == "key_conflict"
            else "the stored row no longer matches what was accepted, it would only die again"
        )
        return ReplayResult(
            dead_letter_id,
            NOT_REPLAYABLE,
            detail=f"{row.reason} is never replayed: {why}; resolve by hand",
        )
    if row.expired:
        return ReplayResult(dead_letter_id, KEY_EXPIRED, detail=WILL_NOT_RESEND)
    return None


def replay(
    conn: Connection, dead_letter_id: int, key_trust_seconds: float, by: str
) -> ReplayResult:
    """Replay one dead letter (one conditional statement; ``conn`` in autocommit or the
    caller commits)."""
    row = conn.execute(
        _REPLAY, {"id": dead_letter_id, "trust": key_trust_seconds, "by": by}
    ).first()
    if row is not None:
        return ReplayResult(
            dead_letter_id, REPLAYED, str(row.account_id), str(row.batch_id), LOOK_UP_FIRST
        )
    refusal = replay_refusal(conn, dead_letter_id, key_trust_seconds)
    # nothing changed, but nothing refuses any more: a concurrent replay or resolve won
    return refusal or ReplayResult(dead_letter_id, NOT_DEAD, detail="no longer dead")


# ---- resolve ---------------------------------------------------------------------------------

# One statement: dead -> succeeded|failed by hand (nothing is sent), the dead letter closed
# with who, when and why, and a completed batch's counts moved along. A dead letter without a
# transaction (task_crashed) is only closed.
_RESOLVE = text("""
WITH tx AS (
    UPDATE transactions t SET status = :as_status, updated_at = now(),
        last_error_class = 'resolved_by_hand',
        last_error = 'resolved by ' || CAST(:by AS text) || ': ' || CAST(:note AS text)
    FROM dead_letters d
    WHERE d.id = :id AND d.transaction_pk = t.id AND d.resolved_at IS NULL
      AND t.status = 'dead'
    RETURNING t.id, t.batch_pk
),
dl AS (
    UPDATE dead_letters d SET resolved_at = now(), resolved_by = :by,
        resolution_note = :note,
        payload = d.payload || jsonb_build_object('resolved_as', CAST(:as_status AS text))
    WHERE d.id = :id AND d.resolved_at IS NULL
      AND (d.transaction_pk IS NULL OR d.transaction_pk IN (SELECT id FROM tx))
    RETURNING d.id
),
counts AS (
    -- written whatever the batch's status, as the replay's reopened: a completion that read
    -- the item dead either wrote first (its counts are moved along here) or completes nothing
    UPDATE batches b SET
        dead_count = b.dead_count - CASE WHEN b.status = 'completed' THEN 1 ELSE 0 END,
        succeeded_count = b.succeeded_count
            + CASE WHEN b.status = 'completed' AND :as_status = 'succeeded' THEN 1 ELSE 0 END,
        failed_count = b.failed_count
            + CASE WHEN b.status = 'completed' AND :as_status = 'failed' THEN 1 ELSE 0 END,
        updated_at = now()
    FROM tx WHERE b.id = tx.batch_pk
)
SELECT id FROM dl
""")

RESOLVED = "resolved"


def resolve(conn: Connection, dead_letter_id: int, as_status: str, note: str, by: str) -> str:
    """Resolve one dead letter by hand; returns RESOLVED, NOT_FOUND or NOT_DEAD."""
    if as_status not in ("succeeded", "failed"):
        raise ValueError(f"resolve as succeeded or failed, not {as_status!r}")
    params = {"id": dead_letter_id, "as_status": as_status, "note": note, "by": by}
    if conn.execute(_RESOLVE, params).first() is not None:
        return RESOLVED
    exists = conn.execute(
        text("SELECT 1 FROM dead_letters WHERE id = :id"), {"id": dead_letter_id}
    ).first()
    return NOT_DEAD if exists is not None else NOT_FOUND


# ---- task_crashed ----------------------------------------------------------------------------

_CRASHED = text("""
INSERT INTO dead_letters (batch_pk, reason, error_class, payload)
VALUES ((SELECT id FROM batches WHERE batch_id = CAST(:batch_id AS text)), :reason, :error_class,
        CAST(:payload AS jsonb))
RETURNING id
""")


def record_task_crash(
    conn: Connection,
    *,
    task_name: str,
    args: list[Any],
    error_class: str,
    error: str,
    traceback_digest: str,
    batch_id: str | None,
    task_id: str | None,
) -> int:
    """Write a ``task_crashed`` dead letter (``batch_pk`` set when the batch exists, NULL
    otherwise: migration 0004 allows that for this reason only); returns its id."""
    payload = {
        "task_name": task_name,
        "task_id": task_id,
        "args": args,
        "last_error": error[:1000],
        "traceback_digest": traceback_digest,
        "batch_id": batch_id,
    }
    params = {
        "batch_id": batch_id,
        "reason": TASK_CRASHED,
        "error_class": error_class,
        "payload": jsonb.dumps(payload, default=repr),
    }
    return int(conn.execute(_CRASHED, params).scalar_one())


def as_json(dl: DeadLetter) -> dict[str, Any]:
    """A dead letter as JSON-ready values (datetimes as ISO strings)."""
    out: dict[str, Any] = {}
    for k, v in dl.row.items():
        out[k] = v.isoformat() if isinstance(v, datetime) else v
    return out
