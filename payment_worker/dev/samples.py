"""Synthetic batches for the demo, the tests and the benchmarks."""

from __future__ import annotations

from typing import Any


def make_batches(
    *,
    batches: int,
    items: int,
    accounts: int,
    prefix: str = "b",
    reject_every: int = 0,
    amount: int = 150_000,
) -> list[dict[str, Any]]:
    """``batches`` batches of ``items`` items, spread round-robin over ``accounts`` accounts.

    With ``reject_every=n``, every n-th item's beneficiary account starts with ``REJECT``, which
    the simulator declines (402), so the failed path is exercised too.
    """
    out: list[dict[str, Any]] = []
    n = 0
    for b in range(batches):
        account = f"acct-{b % accounts:04d}"
        rows = []
        for i in range(items):
            n += 1
            number = f"REJECT{n:08d}" if reject_every and n % reject_every == 0 else f"{n:010d}"
            rows.append(
                {
                    "transaction_id": f"{prefix}-tx-{b:05d}-{i:05d}",
                    "amount": amount + i,
                    "currency": "IDR",
                    "beneficiary": {"bank_code": "014", "account_number": number, "name": "Budi"},
                }
            )
        out.append({"batch_id": f"{prefix}-batch-{b:05d}", "account_id": account, "items": rows})
    return out
