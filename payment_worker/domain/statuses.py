"""Every status the service stores, as enums, and the sets of transaction statuses.

The values are the strings of the database rows and of the JSON output; they never change.
A status set is defined here once, from the enum, and everything else (the state machine,
the CHECK constraints, the SQL of the worker, the exporter) uses these sets.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class TxStatus(StrEnum):
    """The state of one transaction (``transactions.status``)."""

    PENDING = "pending"  # accepted, never sent
    DISPATCHING = "dispatching"  # claimed to send: the request may be on the wire
    RETRYABLE = "retryable"  # not applied, to send again after a delay
    UNKNOWN = "unknown"  # maybe sent: only a lookup may decide
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # declined or rejected by the gateway: nothing was paid
    DEAD = "dead"  # given up; a dead letter tells why


class BatchStatus(StrEnum):
    """The state of one batch (``batches.status``)."""

    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"


class KeyStatus(StrEnum):
    """What is known of one idempotency key at the gateway (``idempotency_keys.status``)."""

    NEW = "new"
    SENT = "sent"  # sent, answer unknown
    APPLIED = "applied"
    DECLINED = "declined"
    REJECTED = "rejected"
    NOT_APPLIED = "not_applied"
    # a 422: the gateway held another body under the key, and no lookup has told what yet.
    # Kept until a final answer: a 404 after it is a conflict for a person, never a resend
    CONFLICT = "conflict"


class DeadReason(StrEnum):
    """Why a transaction went dead (``dead_letters.reason``)."""

    RETRIES_EXHAUSTED = "retries_exhausted"
    UNKNOWN_UNRESOLVED = "unknown_unresolved"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    # the gateway holds another answer under the key (a 422 whose lookup does not match)
    KEY_CONFLICT = "key_conflict"
    # a lookup said "not found" after the gateway may have forgotten the key: never resent
    IN_DOUBT_KEY_EXPIRED = "in_doubt_key_expired"


TERMINAL_TX_STATUSES: Final = frozenset({TxStatus.SUCCEEDED, TxStatus.FAILED, TxStatus.DEAD})
"""States a transaction never leaves."""

OPEN_TX_STATUSES: Final = frozenset(TxStatus) - TERMINAL_TX_STATUSES
"""States with work left: pending, dispatching, retryable, unknown."""

IN_DOUBT_TX_STATUSES: Final = frozenset({TxStatus.DISPATCHING, TxStatus.UNKNOWN})
"""Open states where a request may have reached the gateway: resolved by lookup, never resent
blindly."""

SENDABLE_TX_STATUSES: Final = OPEN_TX_STATUSES - IN_DOUBT_TX_STATUSES
"""Open states where no request can be in flight: pending, retryable."""
