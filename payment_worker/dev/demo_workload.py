"""What the demo submits and what the gateway simulator does to it.

The batches are synthetic (:func:`payment_worker.dev.samples.make_batches`) or read from a
file, with ids made unique to the run so the demo can run again at once against the same
database. The submissions go through the producer's public function, as ``payment-worker
submit`` does, and are shown as its JSON lines would show them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from payment_worker.dev.samples import make_batches
from payment_worker.runtime import Runtime

# what the simulator is started with: every fault the issue names, often enough to be seen in
# a few hundred items, rarely enough that the run ends in seconds
SIM_FAULTS: dict[str, float] = {
    "p503": 0.05,  # 503: nothing applied, retried after a backoff
    "p_lost": 0.03,  # applied, then the connection is reset: in doubt, looked up
    "p_hold": 0.01,  # the key stays in flight (409) for hold_seconds, then applied
    "hold_seconds": 3.0,
    "token_ttl": 5.0,  # short: every account's token expires and is refreshed during the run
    "latency_ms": 5.0,
    "latency_jitter_ms": 4.0,
}
SIM_RATE = 6.0  # requests/s per account, the simulator's limit and the client's pacing alike
DECLINE_EVERY = 37  # every n-th item goes to a blocked beneficiary (402, final)


def describe_faults() -> str:
    """One line on the faults switched on, for the demo's header."""
    f = SIM_FAULTS
    return (
        f"{f['p503']:.0%} 503s, {f['p_lost']:.0%} lost responses, "
        f"{f['p_hold']:.0%} keys held in flight {f['hold_seconds']:g} s, "
        f"declined beneficiaries, token TTL {f['token_ttl']:g} s"
    )


def synthetic_batches(run_id: str, *, accounts: int, items: int) -> list[dict[str, Any]]:
    """About ``items`` items over ``accounts`` accounts, two batches per account."""
    per_batch = max(1, -(-items // (2 * accounts)))  # ceil
    batches = make_batches(
        batches=2 * accounts,
        items=per_batch,
        accounts=accounts,
        prefix=f"demo-{run_id}",
        reject_every=DECLINE_EVERY,
    )
    for b in batches:
        b["account_id"] = f"demo-{b['account_id']}"
    # trim the last batches so the total is exactly ``items``
    extra = 2 * accounts * per_batch - items
    for b in reversed(batches):
        if extra <= 0:
            break
        cut = min(extra, len(b["items"]) - 1)
        del b["items"][len(b["items"]) - cut :]
        extra -= cut
    return batches


def batches_from_file(path: Path, run_id: str) -> list[dict[str, Any]]:
    """The file's batches (one object, an array, or JSON lines) with ids unique to this run,
    and their accounts under a ``demo-`` prefix: with the URLs of real servers set, the demo
    must not take a real account's lock or overwrite its gateway token with the simulator's."""
    text = path.read_text()
    try:
        data = json.loads(text)
        batches = data if isinstance(data, list) else [data]
    except ValueError:
        batches = [json.loads(line) for line in text.splitlines() if line.strip()]
    for b in batches:
        b["batch_id"] = f"{b['batch_id']}-{run_id}"
        b["account_id"] = f"demo-{b['account_id']}"
        for item in b["items"]:
            item["transaction_id"] = f"{item['transaction_id']}-{run_id}"
    return batches


def refused_batches(batches: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """Two submissions the service must refuse: the first batch again (a duplicate), and a
    new batch that reuses a transaction id of the first one (a conflict)."""
    first = batches[0]
    clash = {
        "batch_id": f"demo-{run_id}-reuses-a-transaction-id",
        "account_id": first["account_id"],
        "items": [copy.deepcopy(first["items"][0])],
    }
    return [copy.deepcopy(first), clash]


@dataclass
class Submission:
    """What ``payment-worker submit`` answered for one batch."""

    batch_id: str
    status: str
    items: int
    errors: list[str] = field(default_factory=list)

    def reason(self) -> str:
        """Why a batch was not accepted, in words."""
        if self.status == "duplicate":
            return "the same batch was submitted before: nothing stored or enqueued again"
        return "; ".join(self.errors) or self.status


def submit_all(batches: list[dict[str, Any]], runtime: Runtime) -> list[Submission]:
    """Submit each batch as ``payment-worker submit`` does (validate, store, publish)."""
    from payment_worker.producer.submit import submit_batch

    out: list[Submission] = []
    for b in batches:
        d = submit_batch(b, runtime=runtime).to_json()
        errors = [_error_text(e) for e in d.get("errors") or []]
        out.append(Submission(str(d.get("batch_id")), str(d["status"]), int(d["items"]), errors))
    return out


def _error_text(error: Any) -> str:
    # the submit command's errors are {"path", "message"} objects; the message says it all
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return error if isinstance(error, str) else json.dumps(error)


def write_jsonl(path: Path, batches: list[dict[str, Any]]) -> Path:
    """The batches as JSON lines (the submit command's input)."""
    path.write_text("".join(json.dumps(b) + "\n" for b in batches))
    return path


def script_faults(sim_url: str, accounts: list[str]) -> None:
    """Make sure the rarer faults happen at least once, whatever the random draws: a key held
    in flight on the first account, a lost response on the second."""
    scripts = [("hold", {"seconds": SIM_FAULTS["hold_seconds"]}), ("lost", {})]
    for account, (fault, extra) in zip(accounts, scripts, strict=False):
        answer = {"fault": fault, "endpoint": "create", **extra}
        httpx.post(
            f"{sim_url}/_sim/script",
            json={"account_id": account, "answers": [answer]},
            timeout=10,
        ).raise_for_status()
