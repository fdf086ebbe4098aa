"""The demo's report: what happened, from three witnesses, and how it is shown.

* Postgres (:func:`payment_worker.db.reports.run_summary`): final states, dead reasons,
  sends and lookups per transaction. It survives any worker being killed.
* The gateway simulator's ledger: what the gateway did (faults, 503s, 429s, 401s, tokens per
  account) and above all how many times each transaction was paid.
* The workers' own ``/metrics`` (each worker gets a METRICS_PORT), scraped while they run:
  retries scheduled, lookups, lock contention, lost locks, fencing rejections. A killed
  worker's figures are the ones of its last scrape, so these are lower bounds under chaos.

The JSON form (``--json-report PATH``) is the machine-checkable one; the text form ends with
a stable ``double payments: N`` line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from payment_worker.db.reports import RunSummary
from payment_worker.dev.demo_workload import Submission
from payment_worker.dev.reconcile import Reconciliation

# (sample name, its labels sorted) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 1.0) -> Samples | None:
    """The samples of one Prometheus endpoint, or None when it does not answer."""
    try:
        text = httpx.get(url, timeout=timeout).text
    except httpx.HTTPError:
        return None
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


@dataclass
class WorkerMetrics:
    """The last scrape of each worker's /metrics (by worker name: a restarted worker has a
    new name, so nothing is counted twice)."""

    urls: dict[str, str] = field(default_factory=dict)
    last: dict[str, Samples] = field(default_factory=dict)

    def watch(self, name: str, url: str) -> None:
        """Scrape ``url`` as worker ``name`` from now on."""
        self.urls[name] = url

    def forget(self, name: str) -> None:
        """Stop scraping ``name`` (killed): its last figures stay."""
        self.urls.pop(name, None)

    def refresh(self) -> None:
        """Scrape every watched worker once (a paused or dead one keeps its last figures)."""
        for name, url in list(self.urls.items()):
            got = scrape(url, timeout=0.3)
            if got is not None:
                self.last[name] = got

    def total(self, name: str) -> float:
        """The sum of one counter over all its labels and all workers."""
        return sum(self.by_label(name).values())

    def by_label(self, name: str) -> dict[str, float]:
        """One counter summed over workers, per label values (joined by ``,``)."""
        out: dict[str, float] = {}
        for samples in self.last.values():
            for (metric, labels), value in samples.items():
                if metric == name:
                    label = ",".join(v for _, v in labels)
                    out[label] = out.get(label, 0.0) + value
        return out


@dataclass
class DemoReport:
    """Everything the demo reports; ``as_json()`` is the ``--json-report`` file."""

    run_id: str
    run_dir: str
    chaos: bool
    accounts: int
    items: int
    batch_ids: list[str]
    elapsed_seconds: float
    final: dict[str, int]
    not_final: int
    dead_reasons: dict[str, int]
    failed_reasons: dict[str, int]
    refused: list[dict[str, Any]]
    retries_by_reason: dict[str, int]
    retries_scheduled: dict[str, int]
    sends: int
    lookups: int
    in_doubt_resolved_by_lookup: dict[str, int]
    lock_contention: int
    locks_lost: dict[str, int]
    fencing_rejections: int
    tokens_issued_per_account: dict[str, int]
    double_payments: int
    double_paid: list[str]
    lost: int
    reconciliation: dict[str, Any]
    chaos_events: list[str]
    exporter_url: str
    next_steps: list[str] = field(default_factory=list)

    @property
    def items_per_second(self) -> float:
        """Items that reached a final state per second of processing."""
        done = sum(self.final.values())
        return done / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        """No double payment, nothing lost, and Postgres agrees with the gateway."""
        return self.double_payments == 0 and self.lost == 0 and bool(self.reconciliation["ok"])

    def as_json(self) -> dict[str, Any]:
        """The report as JSON (stable field names: tests and CI read them)."""
        out = asdict(self)
        out["items_per_second"] = round(self.items_per_second, 1)
        out["elapsed_seconds"] = round(self.elapsed_seconds, 2)
        out["ok"] = self.ok
        return out

    def write_json(self, path: Path) -> None:
        """Write :meth:`as_json` to ``path``."""
        path.write_text(json.dumps(self.as_json(), indent=2) + "\n")


def build_report(
    *,
    head: dict[str, Any],
    summary: RunSummary,
    rec: Reconciliation,
    ledger: dict[str, Any],
    metrics: WorkerMetrics,
    refused: Iterable[Submission],
    accounts: Iterable[str],
) -> DemoReport:
    """Assemble the report from Postgres, the simulator's ledger and the workers' metrics.

    ``head`` holds the run's own facts (run_id, run_dir, chaos, items, batch_ids,
    elapsed_seconds, chaos_events, exporter_url, next_steps).
    """
    final = {s: summary.by_status.get(s, 0) for s in ("succeeded", "failed", "dead")}
    statuses = {str(k): int(v) for k, v in ledger.get("statuses", {}).items()}
    faults = {str(k): int(v) for k, v in ledger.get("faults", {}).items()}
    # what the gateway answered that called for another try, as the gateway saw it
    retries = {
        "503 service unavailable (nothing applied)": statuses.get("503", 0),
        "response lost (connection reset: in doubt)": faults.get("lost", 0),
        "key held in flight (409 until the hold ends)": statuses.get("409", 0),
        "429 rate limited": int(ledger.get("http_429", 0)),
        "401 token expired or revoked": int(ledger.get("http_401", 0)),
        "500/502/504 (maybe applied: in doubt)": sum(
            statuses.get(c, 0) for c in ("500", "502", "504")
        ),
    }
    per_account = {str(k): int(v) for k, v in ledger.get("tokens_issued_per_account", {}).items()}
    ours = set(accounts)
    lost = (
        len(rec.not_terminal)
        + len(rec.succeeded_not_paid)
        + len(rec.paid_not_succeeded)
        + len(rec.unknown_to_us)
    )
    return DemoReport(
        **head,
        accounts=len(ours),
        final=final,
        not_final=sum(n for s, n in summary.by_status.items() if s not in final),
        dead_reasons=summary.dead_reasons,
        failed_reasons={c or e or "?": n for c, (e, n) in summary.failed_errors.items()},
        refused=[
            {"batch_id": s.batch_id, "status": s.status, "reason": s.reason()} for s in refused
        ],
        retries_by_reason={k: v for k, v in retries.items() if v},
        retries_scheduled={k: int(v) for k, v in metrics.by_label(_RETRIES).items()},
        sends=summary.attempts,
        lookups=summary.lookups,
        in_doubt_resolved_by_lookup={
            s: n for s, n in summary.looked_up.items() if n and s in ("succeeded", "failed")
        },
        lock_contention=int(metrics.total("payment_worker_lock_contention_total")),
        locks_lost={
            k: int(v) for k, v in metrics.by_label("payment_worker_lock_lost_total").items()
        },
        fencing_rejections=int(metrics.total("payment_worker_fencing_rejections_total")),
        tokens_issued_per_account={a: n for a, n in sorted(per_account.items()) if a in ours},
        double_payments=len(ledger.get("double_payments", rec.double_paid)),
        double_paid=list(ledger.get("double_payments", rec.double_paid))[:10],
        lost=lost,
        reconciliation=rec.summary(),
    )


_RETRIES = "payment_worker_transaction_retries_total"


def _counts(d: dict[str, int], sep: str = " · ") -> str:
    return sep.join(f"{k} {v}" for k, v in d.items() if v) or "none"


def render(report: DemoReport, console: Console) -> None:
    """Print the report as a table, then what to try next."""
    r = report
    t = Table(title="what happened", show_header=False, title_justify="left", expand=False)
    t.add_column("what", style="bold")
    t.add_column("result")
    done = sum(r.final.values())
    t.add_row("items", f"{r.items} submitted over {r.accounts} accounts, {done} final")
    t.add_row("succeeded", str(r.final["succeeded"]))
    failed = _counts(r.failed_reasons)
    t.add_row("failed", f"{r.final['failed']}" + (f"  ({failed})" if r.final["failed"] else ""))
    dead = _counts(r.dead_reasons)
    t.add_row("dead", f"{r.final['dead']}" + (f"  ({dead})" if r.final["dead"] else ""))
    if r.not_final:
        t.add_row("NOT final", f"[red]{r.not_final}[/red]")
    refused = {s["status"]: 0 for s in r.refused}
    for s in r.refused:
        refused[s["status"]] += 1
    t.add_row("refused", f"{_counts(refused)}  (the reasons are above)")
    t.add_row("retries by reason", _counts(r.retries_by_reason, "\n"))
    sched = {"not applied, sent again": r.retries_scheduled.get("retryable", 0)}
    sched["in doubt, looked up"] = r.retries_scheduled.get("unknown", 0)
    t.add_row("retries scheduled", _counts(sched))
    t.add_row("sends / lookups", f"{r.sends} sends for {r.items} items, {r.lookups} lookups")
    resolved = sum(r.in_doubt_resolved_by_lookup.values())
    t.add_row(
        "in doubt, resolved by lookup",
        f"{resolved}  ({_counts(r.in_doubt_resolved_by_lookup)})",
    )
    t.add_row("lock contention", f"{r.lock_contention} attempts found the account busy")
    if r.chaos:
        t.add_row("locks lost", _counts(r.locks_lost))
        t.add_row("fencing rejections", f"{r.fencing_rejections} stale writes refused")
    tokens = r.tokens_issued_per_account
    t.add_row("tokens per account", " · ".join(f"{a} {n}" for a, n in tokens.items()) or "none")
    style = "green" if r.double_payments == 0 else "red"
    t.add_row("double payments", f"[{style}]{r.double_payments}[/{style}] (the gateway's ledger)")
    t.add_row("lost", f"[{'green' if r.lost == 0 else 'red'}]{r.lost}[/]")
    t.add_row("elapsed", f"{r.elapsed_seconds:.1f} s, {r.items_per_second:.0f} items/s")
    console.print(t)
    # stable, greppable lines: CI and people check these
    console.print(f"double payments: {r.double_payments}", highlight=False)
    console.print(f"lost: {r.lost}", highlight=False)
    if r.next_steps:
        console.print("\n[bold]try next[/bold]")
        for step in r.next_steps:
            console.print(f"  {step}", highlight=False, soft_wrap=True)
