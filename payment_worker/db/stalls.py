"""The sweeper's queries: accounts whose due work nobody is making progress on.

Read-only: the sweeper never writes an item or a batch row; it re-enqueues the account, and a
holder resolves it under its own fence (docs/processing.md, "The sweeper"). The statements
of the drain itself are in :mod:`payment_worker.db.work`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text

from payment_worker.db.models import OPEN_TX_PREDICATE, sql_values
from payment_worker.domain.statuses import IN_DOUBT_TX_STATUSES, OPEN_TX_STATUSES

_OPEN = sql_values(OPEN_TX_STATUSES)
_IN_DOUBT = sql_values(IN_DOUBT_TX_STATUSES)

# Stale accounts first: with :every (a registered holder is dead) the limit would otherwise
# be filled by a healthy backlog's oldest work, and the accounts needing a repair (a lost
# delayed retry, the dead holder's own) left out while the dead holder stays registered.
# Every due open item is read once a pass: the aggregate runs over transactions alone, and
# only the (at most :limit) accounts it keeps are joined to their batches (joining every due
# item first cost a third more). The message goes to the account's oldest batch with due
# work. Issue 13's backlog measurement (1,000,000 due items, 20,000 accounts): 0.6 s a pass,
# 0.9 s with the parallel workers off as the sweeper runs it (stalled_accounts), against
# 0.85-0.98 s on three processes, i.e. three times the CPU, joined first.
_STALLED = text(f"""
SELECT s.account_id, b.batch_id, s.in_doubt, s.stale
FROM (
    SELECT t.account_id, min(t.batch_pk) AS batch_pk,
           bool_or(t.status IN ({_IN_DOUBT})) AS in_doubt,
           max(t.updated_at) < now() - make_interval(secs => :stale) AS stale,
           min(t.next_attempt_at) AS first_due
    FROM transactions t
    WHERE t.status IN ({_OPEN})
      AND t.next_attempt_at <= now()
    GROUP BY t.account_id
    HAVING :every OR max(t.updated_at) < now() - make_interval(secs => :stale)
    ORDER BY stale DESC, first_due
    LIMIT :limit
) s
JOIN batches b ON b.id = s.batch_pk
ORDER BY s.stale DESC, s.first_due
""")

# a background pass on one backend: a parallel plan would take every core of a small
# database host from the drains' statements for the length of the pass (SET LOCAL: this
# transaction only, so nothing is left on a pooled or PgBouncer connection)
_ONE_BACKEND = text("SET LOCAL max_parallel_workers_per_gather = 0")


@dataclass(frozen=True, slots=True)
class StalledAccount:
    """An account with due open items and no progress for a while, or (``uncompleted``) one
    with a batch whose items are all terminal and that nobody completed."""

    account_id: str
    batch_id: str
    in_doubt: bool  # has dispatching/unknown items: the next holder resolves them by lookup
    uncompleted: bool = False  # only a batch to complete: every item of it is terminal
    stale: bool = True  # no write for the stale period (False only with ``every=True``)


def stalled_accounts(
    conn: Connection, stale_after: float, limit: int = 500, *, every: bool = False
) -> list[StalledAccount]:
    """Accounts whose due open items saw no write for ``stale_after`` seconds (for the
    sweeper); with ``every``, all accounts with due open items, each marked ``stale`` or not
    (the sweeper checks every one's holder for liveness, and re-enqueues only stale ones)."""
    params = {"stale": stale_after, "limit": limit, "every": every}
    conn.execute(_ONE_BACKEND)
    rows = conn.execute(_STALLED, params).all()
    return [
        StalledAccount(r.account_id, r.batch_id, bool(r.in_doubt), stale=bool(r.stale))
        for r in rows
    ]


# Batches not completed although every item is terminal, untouched for :stale seconds: a
# drain that ended (lock lost, fenced out, crashed) between recording a batch's last items and
# completing it (two statements in older releases; now only after a chunk that claimed more)
# leaves the batch "processing" and, with no due item left, nothing would ever start a
# holder for it. Every open batch gets one probe for an open item through the partial index
# (transactions_open_account_order_idx, whose predicate the probe spells); OFFSET 0 keeps the
# probe a correlated subplan: flattened into an anti join, the planner ran it, on stale
# statistics, as a hash join over a scan of every transaction, or with a full index scan
# as its inner side for each open batch (19 s a pass). The age is read only for batches the
# probe passes (the cheaper filter runs first).
_UNCOMPLETED = text(f"""
SELECT b.account_id, min(b.batch_id) AS batch_id
FROM batches b
WHERE b.status <> 'completed'
  AND NOT EXISTS (
      SELECT 1 FROM transactions t
      WHERE t.account_id = b.account_id AND t.batch_pk = b.id AND t.{OPEN_TX_PREDICATE}
      OFFSET 0
  )
  AND (SELECT max(t.updated_at) FROM transactions t WHERE t.batch_pk = b.id)
      < now() - make_interval(secs => :stale)
GROUP BY b.account_id
ORDER BY min(b.id)
LIMIT :limit
""")


_STILL_STALLED = text(f"""
SELECT t.account_id FROM transactions t
WHERE t.account_id = ANY(:accts) AND t.{OPEN_TX_PREDICATE} AND t.next_attempt_at <= now()
GROUP BY t.account_id
HAVING max(t.updated_at) < now() - make_interval(secs => :stale)
""")


def still_stalled(conn: Connection, account_ids: list[str], stale_after: float) -> set[str]:
    """Of ``account_ids``, those that still have due open items untouched for
    ``stale_after`` seconds now (the sweeper's second look, right before it re-enqueues: a
    holder may have drained the account since its first query)."""
    if not account_ids:
        return set()
    rows = conn.execute(_STILL_STALLED, {"accts": list(account_ids), "stale": stale_after}).all()
    return {str(r.account_id) for r in rows}


def uncompleted_batch_accounts(
    conn: Connection, stale_after: float, limit: int = 500
) -> list[StalledAccount]:
    """Accounts with a batch left not completed although all its items are terminal and
    none was written for ``stale_after`` seconds (for the sweeper: a holder completes it
    under its fence; the sweeper itself never writes a batch row)."""
    rows = conn.execute(_UNCOMPLETED, {"stale": stale_after, "limit": limit}).all()
    return [StalledAccount(r.account_id, r.batch_id, False, uncompleted=True) for r in rows]
