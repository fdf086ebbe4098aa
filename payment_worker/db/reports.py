"""Read-only reports on what the database holds, for the tools and the exporter.

The SQL of ``payment-worker demo``, of the reconciliation with the gateway ledger and of the
exporter's gauges. Each function takes a Connection and returns plain data; none writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from psycopg import errors as pg_errors
from sqlalchemy import Connection, text
from sqlalchemy.exc import OperationalError

from payment_worker.db.models import OPEN_TX_PREDICATE, sql_values
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES, BatchStatus, TxStatus

_TX_COUNTS_OF_BATCHES = text(
    "SELECT t.status, count(*) FROM transactions t JOIN batches b ON b.id = t.batch_pk "
    "WHERE b.batch_id = ANY(:ids) GROUP BY t.status"
)
_BATCH_SUMMARIES = text(
    "SELECT b.batch_id, b.status, t.status, count(*) FROM batches b "
    "JOIN transactions t ON t.batch_pk = b.id WHERE b.batch_id = ANY(:ids) "
    "GROUP BY b.batch_id, b.status, t.status ORDER BY b.batch_id, t.status"
)
_TX_STATUSES_ALL = text("SELECT account_id, transaction_id, status FROM transactions")
_TX_STATUSES_OF_BATCHES = text(
    "SELECT t.account_id, t.transaction_id, t.status FROM transactions t "
    "JOIN batches b ON b.id = t.batch_pk WHERE b.batch_id = ANY(:ids)"
)

# Transactions by status without reading every transaction (the table only grows): the open
# ones through the partial index on them; the terminal ones as the counts every completed batch
# keeps (written by its completion, moved by a dlq resolve, reopened by a replay) plus the
# terminal items of the batches still open (through the partial index on those). The
# batches, one pass over their table, a fiftieth of the transactions' at 50 items a batch
_OPEN_TX_BY_STATUS = text(
    f"SELECT status, count(*) FROM transactions WHERE {OPEN_TX_PREDICATE} GROUP BY status"
)
_BATCH_TOTALS = text(
    "SELECT status, count(*) AS batches, coalesce(sum(succeeded_count), 0) AS succeeded,"
    " coalesce(sum(failed_count), 0) AS failed, coalesce(sum(dead_count), 0) AS dead"
    " FROM batches GROUP BY status"
)
_TERMINAL_TX_OF_OPEN_BATCHES = text(
    "SELECT t.status, count(*) FROM batches b JOIN transactions t ON t.batch_pk = b.id"
    f" WHERE b.status <> '{BatchStatus.COMPLETED.value}'"
    f" AND t.status IN ({sql_values(TERMINAL_TX_STATUSES)}) GROUP BY t.status"
)
# the dlq tooling's totals, by reason: open now, resolutions (by hand or by a replay that
# finished; monotonic as long as dead letters are never deleted), and the age of the oldest
# open one
_DEAD_LETTER_TOTALS = text(
    "SELECT reason, count(*) FILTER (WHERE resolved_at IS NULL) AS open,"
    " count(*) FILTER (WHERE resolved_at IS NOT NULL) AS resolved,"
    " coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE resolved_at IS NULL)), 0)"
    " AS oldest_open FROM dead_letters GROUP BY reason"
)
# replays by the reason the item was dead for when it was replayed (the replay history each
# dead letter keeps): an item replayed, then dead again for another reason, changes its dead
# letter's reason, and a sum of replay_count by that reason would go down for the old one,
# a counter reset to Prometheus
_REPLAYS_BY_REASON = text(
    "SELECT r.value->>'reason', count(*) FROM dead_letters d"
    " CROSS JOIN LATERAL jsonb_array_elements(d.payload->'replays') r"
    " WHERE d.replay_count > 0 AND jsonb_typeof(d.payload->'replays') = 'array' GROUP BY 1"
)
# the totals' statements' bound (each), below the alerting reads' (the caller's): all of a
# round within the 10 s a Prometheus scrape is given by default
TOTALS_TIMEOUT_MS = 2000
STALE_DISPATCH_SECONDS = 600
"""A ``dispatching`` item claimed longer ago than this is in doubt, not on its way: a claim
stamps a whole chunk (``PROCESS_CHUNK_SIZE``, 20) whose requests then leave one after
another, each within the pacing wait and the gateway timeouts (10 + 2 + 5 s by default,
340 s for a chunk at worst), so its sender died with it (nothing looks it up until a holder
takes the account: every worker down, the account stuck). Well under the in-doubt alert's
15 minutes."""

# in doubt: unknown, or dispatching again after a doubt (a resend after a 404), or left
# dispatching. Its clock is doubt_since, else its claim; an unknown item without
# doubt_since (a replayed one never in doubt) is dated by its replay
_IN_DOUBT = (
    "status = 'unknown' OR (status = 'dispatching' AND (doubt_since IS NOT NULL"
    " OR coalesce(dispatched_at, updated_at)"
    f" < now() - make_interval(secs => {STALE_DISPATCH_SECONDS})))"
)
# open transactions in one pass, spelled like the predicate of the partial indexes on them:
# in doubt, the oldest pending, the oldest of all, the accounts that have any, and those
# retried in vain (unsent_since: no request has left)
_OPEN_WORK = text(
    f"SELECT count(*) FILTER (WHERE {_IN_DOUBT}) AS in_doubt,"
    " coalesce(extract(epoch FROM now() - min(coalesce(doubt_since,"
    " CASE WHEN status = 'dispatching' THEN dispatched_at END, updated_at))"
    f" FILTER (WHERE {_IN_DOUBT})), 0) AS oldest_in_doubt,"
    " coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)"
    " AS oldest_pending,"
    " coalesce(extract(epoch FROM now() - min(created_at)), 0) AS oldest_open,"
    " count(DISTINCT account_id) AS accounts,"
    " coalesce(extract(epoch FROM now() - min(unsent_since)), 0) AS oldest_unsent,"
    " count(DISTINCT account_id) FILTER (WHERE unsent_since IS NOT NULL) AS accounts_unsent"
    f" FROM transactions WHERE {OPEN_TX_PREDICATE}"
)


def transaction_counts(conn: Connection, batch_ids: Sequence[str]) -> dict[str, int]:
    """Transactions of the named batches per status (statuses without any left out)."""
    rows = conn.execute(_TX_COUNTS_OF_BATCHES, {"ids": list(batch_ids)}).all()
    return {str(r[0]): int(r[1]) for r in rows}


def batch_summaries(conn: Connection, batch_ids: Sequence[str]) -> list[tuple[str, str, str, int]]:
    """``(batch_id, batch status, transaction status, count)`` of the named batches, ordered by
    batch id, then transaction status."""
    rows = conn.execute(_BATCH_SUMMARIES, {"ids": list(batch_ids)}).all()
    return [(str(b), str(bs), str(ts), int(n)) for b, bs, ts, n in rows]


def transaction_statuses(
    conn: Connection, batch_ids: Iterable[str] | None = None
) -> list[tuple[str, str, str]]:
    """``(account_id, transaction_id, status)`` of every transaction of the named batches
    (of every batch when None)."""
    if batch_ids is None:
        result = conn.execute(_TX_STATUSES_ALL)
    else:
        result = conn.execute(_TX_STATUSES_OF_BATCHES, {"ids": list(batch_ids)})
    return [(str(a), str(t), str(s)) for a, t, s in result]


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """What the database holds right now (the exporter's gauges). Per-status and per-reason
    maps leave out what has none; ages are in seconds, 0 when there is nothing.

    ``totals_read`` False: the totals (terminal transactions, batches) were not read in the
    time allowed; ``transactions`` then holds the open statuses only and ``batches`` nothing,
    and every other field was read."""

    transactions: dict[str, int]
    batches: dict[str, int]
    oldest_open_age: float  # the oldest non-terminal transaction, since it was created
    # transactions that may have been paid, outcome not known: unknown, dispatching again
    # after a doubt, or claimed over STALE_DISPATCH_SECONDS ago and still dispatching
    in_doubt: int = 0
    oldest_in_doubt_age: float = 0.0  # since its oldest send in doubt (doubt_since)
    oldest_pending_age: float = 0.0  # the oldest transaction never sent, since created
    accounts_waiting: int = 0  # accounts with at least one non-terminal transaction
    # the oldest first step, since its last request left, of a transaction whose steps have
    # all ended with nothing reaching the gateway (unsent_since); and the accounts with any
    oldest_unsent_age: float = 0.0
    accounts_unsent: int = 0
    # per reason: dead letters open, replayed (replays counted), resolved
    dead_letters_open: dict[str, int] = field(default_factory=dict)
    dead_letters_replayed: dict[str, int] = field(default_factory=dict)
    dead_letters_resolved: dict[str, int] = field(default_factory=dict)
    oldest_open_dead_letter_age: float = 0.0
    totals_read: bool = True


def _totals(conn: Connection) -> tuple[dict[str, int], dict[str, int]]:
    """Terminal transactions by status, and batches by status (see _BATCH_TOTALS)."""
    tx = dict.fromkeys((str(s) for s in TERMINAL_TX_STATUSES), 0)
    batches: dict[str, int] = {}
    for r in conn.execute(_BATCH_TOTALS):
        batches[str(r.status)] = int(r.batches)
        if r.status == BatchStatus.COMPLETED.value:
            for status in TERMINAL_TX_STATUSES:
                tx[str(status)] += int(getattr(r, str(status)))
    for status, n in conn.execute(_TERMINAL_TX_OF_OPEN_BATCHES):
        tx[str(status)] += int(n)
    return {s: n for s, n in tx.items() if n}, batches


def state_snapshot(conn: Connection, *, statement_timeout_ms: int) -> StateSnapshot:
    """Read the state gauges in the caller's transaction, made read-only, each statement
    bounded by ``statement_timeout_ms`` (``SET LOCAL``: both end with the transaction).

    What the alerts read (work in doubt, waiting, unsent; dead letters) comes first; the
    totals last, in a savepoint: a totals read that runs out of time leaves the rest read
    (``totals_read`` False), so a big database never blinds the alerts."""
    conn.execute(text(f"SET LOCAL statement_timeout = {int(statement_timeout_ms)}"))
    # one snapshot for every read: an item or a batch that ends between two of them is
    # counted once, not in neither or in both
    conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
    tx = {str(s): int(n) for s, n in conn.execute(_OPEN_TX_BY_STATUS)}
    work = conn.execute(_OPEN_WORK).one()
    totals = conn.execute(_DEAD_LETTER_TOTALS).all()
    replays = {str(r): int(n) for r, n in conn.execute(_REPLAYS_BY_REASON) if r is not None}
    batches: dict[str, int] = {}
    totals_read = True
    try:
        with conn.begin_nested():
            # their own, shorter bound: a scrape must end within Prometheus's timeout
            conn.execute(text(f"SET LOCAL statement_timeout = {TOTALS_TIMEOUT_MS}"))
            terminal, batches = _totals(conn)
        tx.update(terminal)
    except OperationalError as exc:  # QueryCanceled: the statement timeout
        if not isinstance(exc.orig, pg_errors.QueryCanceled):
            raise
        totals_read = False
    return StateSnapshot(
        tx,
        batches,
        float(work.oldest_open),
        in_doubt=int(work.in_doubt),
        oldest_in_doubt_age=float(work.oldest_in_doubt),
        oldest_pending_age=float(work.oldest_pending),
        accounts_waiting=int(work.accounts),
        oldest_unsent_age=float(work.oldest_unsent),
        accounts_unsent=int(work.accounts_unsent),
        dead_letters_open={str(r.reason): int(r.open) for r in totals if r.open},
        dead_letters_replayed=replays,
        dead_letters_resolved={str(r.reason): int(r.resolved) for r in totals},
        oldest_open_dead_letter_age=max((float(r.oldest_open) for r in totals), default=0.0),
        totals_read=totals_read,
    )


# --- payment-worker demo: what happened to the transactions of its batches --------------
_RUN_BY_STATUS = text(
    "SELECT t.status, count(*), coalesce(sum(t.attempts), 0), coalesce(sum(t.lookups), 0),"
    " count(*) FILTER (WHERE t.lookups > 0) FROM transactions t"
    " JOIN batches b ON b.id = t.batch_pk WHERE b.batch_id = ANY(:ids) GROUP BY t.status"
)
_RUN_DEAD_REASONS = text(
    "SELECT d.reason, count(*) FROM dead_letters d JOIN transactions t ON t.id = d.transaction_pk"
    " JOIN batches b ON b.id = t.batch_pk WHERE b.batch_id = ANY(:ids) GROUP BY d.reason"
)
_RUN_FAILED_ERRORS = text(
    "SELECT coalesce(t.last_error_class, ''), min(coalesce(t.last_error, '')), count(*)"
    " FROM transactions t JOIN batches b ON b.id = t.batch_pk"
    " WHERE b.batch_id = ANY(:ids) AND t.status = :failed GROUP BY 1"
)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """The transactions of a set of batches: per status, why the dead and failed ones ended
    so, and how many sends and lookups it took."""

    by_status: dict[str, int]
    dead_reasons: dict[str, int]
    failed_errors: dict[str, tuple[str, int]]  # error class -> (an example message, count)
    attempts: int
    lookups: int
    looked_up: dict[str, int]  # per status: transactions that needed at least one lookup


def run_summary(conn: Connection, batch_ids: Sequence[str]) -> RunSummary:
    """What happened to the transactions of the named batches (the demo's report)."""
    ids = {"ids": list(batch_ids)}
    by_status: dict[str, int] = {}
    looked_up: dict[str, int] = {}
    attempts = lookups = 0
    for status, n, a, lk, with_lookup in conn.execute(_RUN_BY_STATUS, ids):
        by_status[str(status)] = int(n)
        looked_up[str(status)] = int(with_lookup)
        attempts += int(a)
        lookups += int(lk)
    dead = {str(r): int(n) for r, n in conn.execute(_RUN_DEAD_REASONS, ids)}
    rows = conn.execute(_RUN_FAILED_ERRORS, {**ids, "failed": TxStatus.FAILED.value})
    failed = {str(c): (str(e), int(n)) for c, e, n in rows}
    return RunSummary(by_status, dead, failed, attempts, lookups, looked_up)
