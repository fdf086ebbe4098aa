"""The status enums hold exactly the strings stored in the database and printed in JSON."""

from __future__ import annotations

from payment_worker.db.models import OPEN_TX_PREDICATE, sql_values
from payment_worker.domain.statuses import (
    IN_DOUBT_TX_STATUSES,
    OPEN_TX_STATUSES,
    SENDABLE_TX_STATUSES,
    TERMINAL_TX_STATUSES,
    BatchStatus,
    DeadReason,
    KeyStatus,
    TxStatus,
)


def test_values_are_the_stored_strings() -> None:
    assert [s.value for s in TxStatus] == [
        "pending",
        "dispatching",
        "retryable",
        "unknown",
        "succeeded",
        "failed",
        "dead",
    ]
    assert [s.value for s in BatchStatus] == ["pending", "processing", "completed"]
    assert [s.value for s in KeyStatus] == [
        "new",
        "sent",
        "applied",
        "declined",
        "rejected",
        "not_applied",
        "conflict",
    ]
    assert [s.value for s in DeadReason] == [
        "retries_exhausted",
        "unknown_unresolved",
        "fingerprint_mismatch",
        "key_conflict",
        "in_doubt_key_expired",
    ]


def _values(statuses: frozenset[TxStatus]) -> set[str]:
    return {s.value for s in statuses}


def test_sets_partition_the_transaction_states() -> None:
    assert _values(TERMINAL_TX_STATUSES) == {"succeeded", "failed", "dead"}
    assert _values(OPEN_TX_STATUSES) == {"pending", "dispatching", "retryable", "unknown"}
    assert _values(IN_DOUBT_TX_STATUSES) == {"dispatching", "unknown"}
    assert _values(SENDABLE_TX_STATUSES) == {"pending", "retryable"}
    assert set(TxStatus) == OPEN_TX_STATUSES | TERMINAL_TX_STATUSES
    assert not OPEN_TX_STATUSES & TERMINAL_TX_STATUSES
    assert IN_DOUBT_TX_STATUSES | SENDABLE_TX_STATUSES == OPEN_TX_STATUSES


def test_sql_lists_follow_the_enum_order_whatever_the_set_order() -> None:
    assert sql_values(TERMINAL_TX_STATUSES) == "'succeeded', 'failed', 'dead'"
    assert sql_values(reversed(list(OPEN_TX_STATUSES))) == (
        "'pending', 'dispatching', 'retryable', 'unknown'"
    )
    # the partial indexes' predicate, exactly as the migrations spell it
    assert OPEN_TX_PREDICATE == "status NOT IN ('succeeded', 'failed', 'dead')"
