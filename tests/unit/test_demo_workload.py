"""The demo's batches from a FILE: ids unique to the run, and accounts the demo alone uses
(with real servers' URLs set, a file's own account ids would have had the demo take their
locks and overwrite their gateway tokens with the simulator's; a review found it)."""

from __future__ import annotations

from pathlib import Path

from payment_worker.dev.demo_workload import batches_from_file, refused_batches

SAMPLE = Path(__file__).resolve().parents[2] / "payment_worker" / "dev" / "sample-batch.json"


def test_a_files_batches_get_the_run_suffix_and_demo_accounts() -> None:
    batches = batches_from_file(SAMPLE, "r1")
    assert batches[0]["batch_id"] == "payout-2026-11-29-0001-r1"
    assert batches[0]["items"][0]["transaction_id"] == "tx-0001-r1"
    accounts = {b["account_id"] for b in batches}
    assert accounts == {"demo-acct-42", "demo-acct-77"}, accounts
    # the refusals the demo shows stay on those accounts too
    assert {b["account_id"] for b in refused_batches(batches, "r1")} <= accounts
