"""What the deploy side of observability is checked against: every metric the service exposes,
the PromQL of the dashboard and of the alert rules, and promtool.

Shared by tests/unit/test_alerts.py, tests/unit/test_dashboard.py and tests/unit/test_compose.py;
a test that evaluates the expressions against a real Prometheus can take them from here too
(``dashboard_expressions(substitute=True)`` replaces the ``$instance`` variable by ``.*``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
ALERTS = ROOT / "deploy" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "alerts-tests.yml"
EXPORTER_SRC = ROOT / "payment_worker" / "ops" / "exporter.py"

# The exporter series every helper agreed on (the brief's fixed names): gauges, then counters
# (exposed with _total). The exporter implements them; listing them here keeps the dashboard
# and the rules honest even before and independently of that code.
CONTRACT_GAUGES = frozenset(
    {
        "payment_worker_queue_messages",
        "payment_worker_workers_alive",
        "payment_worker_in_doubt_transactions",
        "payment_worker_oldest_in_doubt_age_seconds",
        "payment_worker_oldest_pending_age_seconds",
        "payment_worker_dead_letters_open",
        "payment_worker_oldest_open_dead_letter_age_seconds",
        "payment_worker_accounts_waiting",
        "payment_worker_transactions",
        "payment_worker_batches",
        "payment_worker_exporter_up",
    }
)
CONTRACT_COUNTERS = frozenset({"payment_worker_submissions_total"})

# Template variables of the dashboard and what "every instance" means for each.
TEMPLATE_DEFAULTS = {"instance": ".*"}
METRIC_TOKEN = re.compile(r"\bpayment_worker_[a-z0-9_]*[a-z0-9]")


@dataclass(frozen=True, slots=True)
class Family:
    """One metric as Prometheus shows it: its name, type and the sample names it exposes."""

    name: str
    kind: str  # counter, gauge, histogram
    samples: frozenset[str]
    source: str  # "worker" (ops/metrics.py) or "exporter"


def _family(name: str, kind: str, source: str) -> Family:
    if kind == "counter":
        base = name.removesuffix("_total")
        return Family(base + "_total", kind, frozenset({base + "_total"}), source)
    if kind == "histogram":
        samples = {name + s for s in ("_bucket", "_sum", "_count")}
        return Family(name, kind, frozenset(samples), source)
    return Family(name, kind, frozenset({name}), source)


def worker_families() -> list[Family]:
    """Every metric object of payment_worker/ops/metrics.py."""
    from prometheus_client import Counter, Gauge, Histogram, Summary
    from prometheus_client.metrics import MetricWrapperBase

    from payment_worker.ops import metrics

    out = []
    for obj in vars(metrics).values():
        if not isinstance(obj, MetricWrapperBase):
            continue
        kind = {Counter: "counter", Gauge: "gauge", Histogram: "histogram", Summary: "summary"}[
            type(obj)
        ]
        out.append(_family(obj._name, kind, "worker"))
    return out


def exporter_families() -> list[Family]:
    """Every series of the exporter: the names in its source, plus the agreed contract names."""
    src = EXPORTER_SRC.read_text()
    found: dict[str, Family] = {}
    # Counter("name" / CounterMetricFamily("name", and a family class passed to a helper
    # before its name: _labelled(CounterMetricFamily, "name", ...)
    typed = re.compile(
        r'\b(Counter|Histogram|Gauge)(?:MetricFamily)?(?:\(|,)\s*"(payment_worker_\w+)"'
    )
    for cls, name in typed.findall(src):
        fam = _family(name, cls.lower(), "exporter")
        found[fam.name] = fam
    spelled = {n for fam in found.values() for n in (fam.name, fam.name.removesuffix("_total"))}
    for name in re.findall(r'"(payment_worker_\w+)"', src):
        if name not in spelled:
            found.setdefault(name, _family(name, "gauge", "exporter"))
    for name in CONTRACT_GAUGES:
        found.setdefault(name, _family(name, "gauge", "exporter"))
    for name in CONTRACT_COUNTERS:
        found.setdefault(name, _family(name, "counter", "exporter"))
    return list(found.values())


def all_families() -> dict[str, Family]:
    """Worker and exporter metrics by exposed name (a name both serve is listed once)."""
    out: dict[str, Family] = {}
    for fam in [*worker_families(), *exporter_families()]:
        out.setdefault(fam.name, fam)
    return out


def sample_names() -> set[str]:
    """Every sample name a PromQL expression of ours may use."""
    return {s for fam in all_families().values() for s in fam.samples}


def metric_tokens(expr: str) -> set[str]:
    """The payment_worker_* names an expression mentions."""
    return set(METRIC_TOKEN.findall(expr))


def dashboards() -> dict[Path, dict[str, Any]]:
    """Every provisioned dashboard, parsed."""
    return {p: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def _substitute(expr: str) -> str:
    for name, value in TEMPLATE_DEFAULTS.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def dashboard_expressions(substitute: bool = False) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and annotation query of every dashboard."""
    out = []
    for path, dash in dashboards().items():
        for panel in dash["panels"]:
            for panel_ in [panel, *panel.get("panels", [])]:
                for t in panel_.get("targets", []):
                    out.append((f"{path.name}: {panel_['title']} ({t['refId']})", t["expr"]))
        for ann in dash.get("annotations", {}).get("list", []):
            if ann.get("expr"):
                out.append((f"{path.name}: annotation {ann['name']}", ann["expr"]))
    if substitute:
        out = [(where, _substitute(expr)) for where, expr in out]
    return out


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of deploy/alerts.yml."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def rule_expressions() -> list[tuple[str, str]]:
    """(alert name, expr) of every rule."""
    return [(r["alert"], r["expr"]) for r in alert_rules()]


def promtool() -> str:
    """Path of promtool; skips the test without it, fails in CI (.ci/run installs it)."""
    found = shutil.which("promtool")
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("promtool is missing in CI: .ci/run installs Debian's prometheus package")
    pytest.skip("promtool not installed (apt-get install prometheus)")
