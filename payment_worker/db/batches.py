"""All the SQL of submission and status: batches, their transactions and idempotency keys.

A submission is ONE statement whatever the batch size, run in autocommit, so it is atomic
and costs one round trip: data-modifying CTEs insert the batch row, every transaction and
every idempotency key, the items travelling as one JSON document. Races are decided by the
unique constraints, never by a check-then-insert: the batch row by ``ON CONFLICT (batch_id)
DO NOTHING`` (a concurrent identical submission waits for the first to commit, then inserts
nothing), a transaction that another batch already owns by the unique violation that aborts
the whole statement.

Submissions of one account are serialized by a transaction-scoped advisory lock taken by
the statement before it writes anything. Two batches sharing transactions in opposite orders
would otherwise lock each other's index entries in opposite orders and deadlock; PostgreSQL
aborts one after ``deadlock_timeout``, and a retry that starts while the winner is still
inserting can meet it again (CI saw three in a row on a loaded host). With the lock, the
second batch waits for the first to commit and then fails on the unique index at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, IntegrityError

# the per-account lock rules out the deadlock of two overlapping batches; a serialization
# failure or a deadlock from elsewhere is still rolled back whole and simply tried again
_RETRYABLE_SQLSTATES = {"40P01", "40001"}
_UNIQUE_VIOLATION = "23505"
# the unique constraints a transaction of another batch trips (its account and transaction
# id, and the idempotency key derived from them); any other (a primary key after a restore
# left a sequence behind) is a database error, not a clash
_CLASH_CONSTRAINTS = frozenset(
    {"transactions_account_tx_key", "transactions_idempotency_key_key", "idempotency_keys_pkey"}
)
_ATTEMPTS = 3

# The namespace of the submission lock (pg_advisory_xact_lock(int, int)): its first key, so
# that it cannot meet another application's advisory locks on a shared database.
_SUBMIT_LOCK_SPACE = 0x70770001

# lk is read by b's INSERT, so the lock is held before the first row is written (an account
# hash collision only serializes two accounts); ORDER BY ord keeps the batch order in the
# transaction ids; with no batch row inserted (batch_id exists) the CROSS JOIN is empty and
# nothing else is written
_INSERT = text(
    f"""
    WITH lk AS (
        SELECT pg_advisory_xact_lock({_SUBMIT_LOCK_SPACE}, hashtext(:account_id)) AS locked
    ),
    b AS (
        INSERT INTO batches (batch_id, account_id, fingerprint, item_count)
        SELECT :batch_id, :account_id, :fingerprint, :item_count FROM lk
        ON CONFLICT (batch_id) DO NOTHING
        RETURNING id
    ),
    src AS (
        SELECT * FROM ROWS FROM (
            json_to_recordset(CAST(:rows AS json))
            AS (transaction_id text, amount bigint, currency text, beneficiary jsonb,
                description text, idempotency_key text, request_fingerprint text)
        ) WITH ORDINALITY AS s(transaction_id, amount, currency, beneficiary, description,
                               idempotency_key, request_fingerprint, ord)
    ),
    tx AS (
        INSERT INTO transactions (batch_pk, account_id, transaction_id, amount, currency,
                                  beneficiary, description, idempotency_key)
        SELECT b.id, :account_id, src.transaction_id, src.amount, src.currency,
               src.beneficiary, src.description, src.idempotency_key
        FROM b CROSS JOIN src ORDER BY src.ord
        RETURNING id, idempotency_key
    ),
    keys AS (
        INSERT INTO idempotency_keys (key, transaction_pk, request_fingerprint)
        SELECT tx.idempotency_key, tx.id, src.request_fingerprint
        FROM tx JOIN src ON src.idempotency_key = tx.idempotency_key
        RETURNING 1
    )
    SELECT (SELECT id FROM b), (SELECT count(*) FROM tx), (SELECT count(*) FROM keys)
    """
)

_EXISTING_TRANSACTIONS = text(
    """
    SELECT t.transaction_id, b.batch_id
    FROM transactions t JOIN batches b ON b.id = t.batch_pk
    WHERE t.account_id = :account_id
      AND t.transaction_id = ANY(CAST(:transaction_ids AS text[]))
    """
)

_BATCH_FINGERPRINT = text("SELECT fingerprint FROM batches WHERE batch_id = :batch_id")

_PENDING = text("SELECT batch_id FROM batches WHERE status <> 'completed' ORDER BY id LIMIT :limit")

_STATUS_COLUMNS = """
    SELECT b.batch_id, b.account_id, b.status,
           t.transaction_id, t.status, t.attempts, t.gateway_payment_id, t.last_error
    FROM batches b LEFT JOIN transactions t ON t.batch_pk = b.id
"""
_STATUS_ALL = text(_STATUS_COLUMNS + " ORDER BY b.id, t.id")
_STATUS_SOME = text(
    _STATUS_COLUMNS + " WHERE b.batch_id = ANY(CAST(:batch_ids AS text[])) ORDER BY b.id, t.id"
)


@dataclass(frozen=True, slots=True)
class NewTransaction:
    """One item of a batch, ready for its row; field names are the JSON keys the insert reads."""

    transaction_id: str
    amount: int
    currency: str
    beneficiary: dict[str, Any]
    description: str | None
    idempotency_key: str
    request_fingerprint: str


@dataclass(frozen=True, slots=True)
class NewBatch:
    """A validated batch, ready for its rows."""

    batch_id: str
    account_id: str
    fingerprint: str
    transactions: Sequence[NewTransaction]


@dataclass(frozen=True, slots=True)
class TransactionClash:
    """An item whose (account_id, transaction_id) already belongs to another batch."""

    index: int
    transaction_id: str
    other_batch_id: str


@dataclass(frozen=True, slots=True)
class InsertOutcome:
    """What the database decided about a submission.

    ``accepted``: rows committed (``batch_pk`` set); ``duplicate``: the same batch_id with
    the same fingerprint exists; ``conflict``: the batch_id exists with another fingerprint;
    ``transactions_exist``: some items belong to other batches (``clashes``), nothing kept.
    """

    status: Literal["accepted", "duplicate", "conflict", "transactions_exist"]
    batch_pk: int | None = None
    clashes: list[TransactionClash] = field(default_factory=list)


def _retryable(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "sqlstate", None) in _RETRYABLE_SQLSTATES


def insert_batch(engine: Engine, batch: NewBatch) -> InsertOutcome:
    """Insert a batch, its transactions and their idempotency keys, atomically.

    All or nothing: unless the outcome is ``accepted`` nothing is left behind. A concurrent
    submission of the same batch_id waits on the unique index for the first one to commit
    or roll back, then sees it; so of many identical racers exactly one is ``accepted``.
    """
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            outcome = _insert_once(engine, batch, last=attempt == _ATTEMPTS)
        except DBAPIError as exc:
            if attempt == _ATTEMPTS or not _retryable(exc):
                raise
            continue
        if outcome is not None:
            return outcome
    raise AssertionError("unreachable: the last attempt returns or raises")


def _insert_once(engine: Engine, batch: NewBatch, *, last: bool) -> InsertOutcome | None:
    """One try; None: a clash whose owner was not found (it rolled back meanwhile): try
    again. On the ``last`` try that clash is raised as the database error it is."""
    txs = batch.transactions
    params = {
        "batch_id": batch.batch_id,
        "account_id": batch.account_id,
        "fingerprint": batch.fingerprint,
        "item_count": len(txs),
        "rows": json.dumps([_row(t) for t in txs]),
    }
    # autocommit: the one statement is its own transaction, with no BEGIN/COMMIT round trips
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        try:
            batch_pk, inserted, keyed = conn.execute(_INSERT, params).one()
        except IntegrityError as exc:
            if getattr(exc.orig, "sqlstate", None) != _UNIQUE_VIOLATION:
                raise
            diag = getattr(exc.orig, "diag", None)
            if getattr(diag, "constraint_name", None) not in _CLASH_CONSTRAINTS:
                raise
            # some (account_id, transaction_id) belongs to a committed batch: name them all
            clashes = _clashes(conn, batch)
            if clashes:
                return InsertOutcome("transactions_exist", clashes=clashes)
            if last:
                raise
            return None
        if batch_pk is None:
            # a new statement, so a new snapshot: it sees the batch that won the race
            existing = conn.execute(_BATCH_FINGERPRINT, {"batch_id": batch.batch_id}).scalar_one()
            return InsertOutcome("duplicate" if existing == batch.fingerprint else "conflict")
        if inserted != len(txs) or keyed != len(txs):  # pragma: no cover - the schema forbids
            raise RuntimeError(f"batch {batch.batch_id!r}: {inserted}/{keyed} of {len(txs)} rows")
        return InsertOutcome("accepted", batch_pk=int(batch_pk))


def _row(t: NewTransaction) -> dict[str, Any]:
    # by hand: dataclasses.asdict deep-copies, and costs more than the insert itself
    return {
        "transaction_id": t.transaction_id,
        "amount": t.amount,
        "currency": t.currency,
        "beneficiary": t.beneficiary,
        "description": t.description,
        "idempotency_key": t.idempotency_key,
        "request_fingerprint": t.request_fingerprint,
    }


def _clashes(conn: Connection, batch: NewBatch) -> list[TransactionClash]:
    rows = conn.execute(
        _EXISTING_TRANSACTIONS,
        {
            "account_id": batch.account_id,
            "transaction_ids": [t.transaction_id for t in batch.transactions],
        },
    ).all()
    owner = {str(tx_id): str(other) for tx_id, other in rows}
    return [
        TransactionClash(i, t.transaction_id, owner[t.transaction_id])
        for i, t in enumerate(batch.transactions)
        if t.transaction_id in owner
    ]


def saved_fingerprint(engine: Engine, batch_id: str) -> str | None:
    """The content fingerprint of the saved batch ``batch_id``, or None when none is saved
    (one read of the unique index on ``batch_id``)."""
    with engine.connect() as conn:
        found = conn.execute(_BATCH_FINGERPRINT, {"batch_id": batch_id}).scalar_one_or_none()
    return None if found is None else str(found)


def pending_batch_ids(conn: Connection, limit: int = 1000) -> list[str]:
    """Ids of batches not ``completed``, oldest first (for the sweeper)."""
    return [str(r) for r in conn.execute(_PENDING, {"limit": limit}).scalars()]


@dataclass(frozen=True, slots=True)
class StatusRow:
    """One item of one batch as the status query returns it (item fields None: no items)."""

    batch_id: str
    account_id: str
    batch_status: str
    transaction_id: str | None
    status: str | None
    attempts: int | None
    gateway_payment_id: str | None
    last_error: str | None


def stream_status(
    conn: Connection, batch_ids: Sequence[str] | None = None, *, chunk: int = 2000
) -> Iterator[StatusRow]:
    """Every item of the named batches (all batches when None), batch by batch, in order.

    Streamed through a server-side cursor ``chunk`` rows at a time, so memory stays flat
    whatever the number of items. ``conn`` must stay open while the iterator is consumed.
    """
    # per statement: Connection.execution_options() would change the caller's connection
    streaming = {"stream_results": True, "yield_per": chunk}
    if batch_ids is None:
        result = conn.execute(_STATUS_ALL, execution_options=streaming)
    else:
        result = conn.execute(
            _STATUS_SOME, {"batch_ids": list(batch_ids)}, execution_options=streaming
        )
    try:
        for row in result:
            yield StatusRow(*row)
    finally:
        result.close()
