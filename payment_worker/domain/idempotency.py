"""Stable identities of a transaction: its gateway Idempotency-Key and its request fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_PREFIX = "pw1-"


def idempotency_key(account_id: str, transaction_id: str) -> str:
    """The Idempotency-Key of a transaction, derived from its stable identity only.

    Never from an attempt or a clock: the same transaction sends the same key on every
    attempt, so a lost response can never turn into a second payment. Length-prefixing
    keeps ``("a-b", "c")`` and ``("a", "b-c")`` apart; the result is 68 printable ASCII
    characters, within the protocol's 1 to 255.
    """
    ident = f"{len(account_id)}:{account_id}:{transaction_id}".encode()
    return KEY_PREFIX + hashlib.sha256(ident).hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces: the same content gives the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()
