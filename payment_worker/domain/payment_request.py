"""What we ask the gateway to pay: one transaction's request body, built one way only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from payment_worker.domain.idempotency import fingerprint, idempotency_key


@dataclass(frozen=True, slots=True)
class PaymentRequest:
    """One transaction as sent to ``POST /v1/accounts/{account_id}/payments``."""

    account_id: str
    transaction_id: str
    amount: int
    currency: str
    beneficiary: dict[str, Any]
    description: str | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body of the protocol; the same transaction always gives the same body."""
        out: dict[str, Any] = {
            "transaction_id": self.transaction_id,
            "amount": self.amount,
            "currency": self.currency,
            "beneficiary": self.beneficiary,
        }
        if self.description is not None:
            out["description"] = self.description
        return out

    @property
    def idempotency_key(self) -> str:
        """The stable Idempotency-Key of this transaction."""
        return idempotency_key(self.account_id, self.transaction_id)

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON body: stored at submission, checked before sending."""
        return fingerprint(self.body())
