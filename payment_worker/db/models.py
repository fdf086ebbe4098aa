"""Table definitions (SQLAlchemy Core). The schema itself is created by the alembic migrations."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from payment_worker.domain.statuses import (
    TERMINAL_TX_STATUSES,
    BatchStatus,
    KeyStatus,
    TxStatus,
)

metadata = MetaData()


def sql_values(values: Iterable[StrEnum]) -> str:
    """Status values as a list of SQL literals, ``'a', 'b'``, for an ``IN (...)``.

    In the enum's definition order, whatever the order of ``values`` (a set, often), so that
    generated SQL is stable and matches the migrations. Only for the enums' own fixed values,
    never for input: nothing is escaped.
    """
    members = list(values)
    if not members:
        raise ValueError("an SQL IN-list needs at least one value")
    order = list(type(members[0]))
    return ", ".join(f"'{v.value}'" for v in sorted(members, key=order.index))


def _in(col: str, values: Iterable[StrEnum]) -> str:
    return f"{col} IN ({sql_values(values)})"


# the predicate of the partial indexes on open transactions; queries spell it the same way so
# that the planner can use them
OPEN_TX_PREDICATE = f"status NOT IN ({sql_values(TERMINAL_TX_STATUSES)})"


batches = Table(
    "batches",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("batch_id", Text, nullable=False, unique=True),
    Column("account_id", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("status", String(16), nullable=False, server_default=BatchStatus.PENDING.value),
    Column("item_count", Integer, nullable=False),
    Column("succeeded_count", Integer, nullable=False, server_default="0"),
    Column("failed_count", Integer, nullable=False, server_default="0"),
    Column("dead_count", Integer, nullable=False, server_default="0"),
    Column("enqueue_count", Integer, nullable=False, server_default="0"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("completed_at", DateTime(timezone=True)),
    CheckConstraint(_in("status", BatchStatus), name="batches_status_check"),
    CheckConstraint("item_count > 0", name="batches_item_count_check"),
)
Index(
    "batches_open_idx",
    batches.c.account_id,
    batches.c.id,
    postgresql_where=text(f"status <> '{BatchStatus.COMPLETED.value}'"),
)

transactions = Table(
    "transactions",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("batch_pk", BigInteger, ForeignKey("batches.id", ondelete="RESTRICT"), nullable=False),
    Column("account_id", Text, nullable=False),
    Column("transaction_id", Text, nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("currency", String(3), nullable=False),
    Column("beneficiary", JSONB, nullable=False),
    Column("description", Text),
    Column("idempotency_key", Text, nullable=False, unique=True),
    Column("status", String(16), nullable=False, server_default=TxStatus.PENDING.value),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("lookups", Integer, nullable=False, server_default="0"),
    Column("next_attempt_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("gateway_payment_id", Text),
    Column("last_error_class", Text),
    Column("last_error", Text),
    Column("fence_token", BigInteger, nullable=False, server_default="0"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # the start of the latest step that may have sent (every claim sets it)
    Column("dispatched_at", DateTime(timezone=True)),
    # the oldest send whose outcome is not known; NULL when nothing is in doubt
    Column("doubt_since", DateTime(timezone=True)),
    # the first step since the last request left that ended with nothing reaching the
    # gateway (such a step uses up no attempt); NULL once one leaves and on terminal rows
    Column("unsent_since", DateTime(timezone=True)),
    # the first send ever in doubt, never cleared (a 404 clears doubt_since, but that send
    # may still land after it): past the key trust nothing is sent any more (0009)
    Column("first_doubt_at", DateTime(timezone=True)),
    UniqueConstraint("account_id", "transaction_id", name="transactions_account_tx_key"),
    CheckConstraint("amount > 0", name="transactions_amount_check"),
    CheckConstraint(_in("status", TxStatus), name="transactions_status_check"),
)
Index("transactions_batch_idx", transactions.c.batch_pk, transactions.c.id)
# one account's open items in batch order: the claim, the drain's last statement, the
# sweeper's per-batch probe. The only partial index of open items (0005 dropped one on
# status and due time: with the same predicate, stale statistics made the planner scan all of
# it for one account's rows)
Index(
    "transactions_open_account_order_idx",
    transactions.c.account_id,
    transactions.c.batch_pk,
    transactions.c.id,
    postgresql_where=text(OPEN_TX_PREDICATE),
)

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("key", Text, primary_key=True),
    Column(
        "transaction_pk",
        BigInteger,
        ForeignKey("transactions.id", ondelete="CASCADE"),
        nullable=False,
        unique=True,
    ),
    Column("request_fingerprint", Text, nullable=False),
    Column("status", String(16), nullable=False, server_default=KeyStatus.NEW.value),
    Column("result_ref", Text),
    Column("fence_token", BigInteger, nullable=False, server_default="0"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint(
        _in("status", KeyStatus),
        name="idempotency_keys_status_check",
    ),
)

account_fences = Table(
    "account_fences",
    metadata,
    Column("account_id", Text, primary_key=True),
    Column("fence_token", BigInteger, nullable=False, server_default="0"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("fence_token >= 0", name="account_fences_token_check"),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("transaction_pk", BigInteger, ForeignKey("transactions.id", ondelete="RESTRICT")),
    Column("batch_pk", BigInteger, ForeignKey("batches.id", ondelete="RESTRICT")),
    Column("reason", Text, nullable=False),
    Column("error_class", Text),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("replay_count", Integer, nullable=False, server_default="0"),
    Column("replayed_at", DateTime(timezone=True)),
    Column("resolved_at", DateTime(timezone=True)),
    Column("resolved_by", Text),
    Column("resolution_note", Text),
    CheckConstraint(
        # migration 0004: a crashed task's row may name neither (a batch id that does not exist)
        "transaction_pk IS NOT NULL OR batch_pk IS NOT NULL OR reason = 'task_crashed'",
        name="dead_letters_ref_check",
    ),
)
# at most one open dead letter per transaction
Index(
    "dead_letters_open_tx_idx",
    dead_letters.c.transaction_pk,
    unique=True,
    postgresql_where=text("resolved_at IS NULL AND transaction_pk IS NOT NULL"),
)
Index("dead_letters_created_idx", dead_letters.c.created_at)
