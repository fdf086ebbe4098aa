"""Reconciliation of Postgres with the gateway's ledger (the simulator's ``/_sim/ledger``).

The invariants of design.md, checked from outside: no transaction paid twice; every
accepted transaction terminal; succeeded here exactly when disbursed there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from payment_worker.db.reports import transaction_statuses
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES, TxStatus


@dataclass
class Reconciliation:
    """The result of comparing Postgres with the gateway ledger."""

    total: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    double_paid: list[str] = field(default_factory=list)
    not_terminal: list[str] = field(default_factory=list)
    paid_not_succeeded: list[str] = field(default_factory=list)
    succeeded_not_paid: list[str] = field(default_factory=list)
    unknown_to_us: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every invariant holds."""
        return not (
            self.double_paid
            or self.not_terminal
            or self.paid_not_succeeded
            or self.succeeded_not_paid
            or self.unknown_to_us
        )

    def summary(self) -> dict[str, Any]:
        """Counts, and the first few offenders of each kind."""
        return {
            "total": self.total,
            "by_status": self.by_status,
            "double_paid": self.double_paid[:10],
            "not_terminal": self.not_terminal[:10],
            "paid_not_succeeded": self.paid_not_succeeded[:10],
            "succeeded_not_paid": self.succeeded_not_paid[:10],
            "unknown_to_us": self.unknown_to_us[:10],
            "ok": self.ok,
        }


def sent_counts(ledger: dict[str, Any]) -> dict[str, int]:
    """``"account_id/transaction_id" -> times money was sent`` from a simulator ledger."""
    return {str(k): int(v) for k, v in ledger.get("sends", {}).items()}


def reconcile(
    conn: Connection, ledger: dict[str, Any], batch_ids: Iterable[str] | None = None
) -> Reconciliation:
    """Compare the transactions of ``batch_ids`` (all when None) with the ledger."""
    sent = sent_counts(ledger)
    rec = Reconciliation()
    ours: set[str] = set()
    for account_id, transaction_id, status in transaction_statuses(conn, batch_ids):
        key = f"{account_id}/{transaction_id}"
        ours.add(key)
        rec.total += 1
        rec.by_status[status] = rec.by_status.get(status, 0) + 1
        n = sent.get(key, 0)
        if n > 1:
            rec.double_paid.append(key)
        if status not in TERMINAL_TX_STATUSES:
            rec.not_terminal.append(key)
        elif status == TxStatus.SUCCEEDED and n == 0:
            rec.succeeded_not_paid.append(key)
        elif status != TxStatus.SUCCEEDED and n > 0:
            rec.paid_not_succeeded.append(key)
    if batch_ids is None:
        rec.unknown_to_us = sorted(k for k, n in sent.items() if n > 0 and k not in ours)
    return rec
