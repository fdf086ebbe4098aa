"""The Grafana dashboard and docs/metrics.md cover every metric the service exposes.

Every worker metric (payment_worker/ops/metrics.py) and exporter series is on some panel, or
listed in NOT_ON_THE_DASHBOARD with the reason; every PromQL expression parses (promtool);
stat panels have thresholds; health comes from ``up{}``; "exporter up" reads 0 rather than
"No data" when the exporter is gone; worker panels follow the ``$instance`` variable.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.observability import (
    ROOT,
    all_families,
    dashboard_expressions,
    dashboards,
    exporter_families,
    metric_tokens,
    promtool,
    sample_names,
)

# name -> why it is on no panel. Empty today: every metric has a panel.
NOT_ON_THE_DASHBOARD: dict[str, str] = {}
# counted outside the workers (producer, dlq commands): no worker instance to filter by
NOT_PER_WORKER = {
    "payment_worker_batches_submitted_total",
    "payment_worker_submit_duplicates_total",
    "payment_worker_enqueue_failures_total",
    "payment_worker_dead_letters_replayed_total",
    "payment_worker_dead_letters_resolved_total",
}


def _panels() -> list[dict[str, Any]]:
    out = []
    for dash in dashboards().values():
        for panel in dash["panels"]:
            out += [panel, *panel.get("panels", [])]
    return out


def _exprs(panel: dict[str, Any]) -> list[str]:
    return [t["expr"] for t in panel.get("targets", [])]


def _used() -> set[str]:
    return {m for _, expr in dashboard_expressions() for m in metric_tokens(expr)}


def test_every_metric_is_on_a_panel_or_says_why_not() -> None:
    used = _used()
    families = all_families()
    missing = [
        name
        for name, fam in families.items()
        if not fam.samples & used and name not in NOT_ON_THE_DASHBOARD
    ]
    assert not missing, f"metrics on no panel (add a panel or a reason): {sorted(missing)}"
    for name in NOT_ON_THE_DASHBOARD:
        assert name in families, f"{name} is exempt but is no metric"
        assert not families[name].samples & used, f"{name} is exempt but is on a panel"


def test_dashboard_uses_only_real_metrics() -> None:
    unknown = _used() - sample_names()
    assert not unknown, f"no such metric: {sorted(unknown)}"


def test_every_expression_parses(tmp_path: Path) -> None:
    # promtool parses PromQL when it checks recording rules: one rule per expression
    exprs = dashboard_expressions(substitute=True)
    assert len(exprs) > 40
    rules = [{"record": f"dashboard:expr_{i}", "expr": expr} for i, (_, expr) in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_instance_variable_filters_every_worker_panel() -> None:
    for dash in dashboards().values():
        names = [v["name"] for v in dash["templating"]["list"]]
        assert "instance" in names
        var = dash["templating"]["list"][names.index("instance")]
        assert var["includeAll"] and var["allValue"] == ".*"
        assert 'up{job="payment-worker"}' in var["definition"]
    exporter = {s for fam in exporter_families() for s in fam.samples}
    worker_only = {
        s
        for fam in all_families().values()
        if fam.source == "worker" and fam.name not in NOT_PER_WORKER
        for s in fam.samples
    } - exporter
    for where, expr in dashboard_expressions():
        if metric_tokens(expr) & worker_only:
            assert 'instance=~"$instance"' in expr, f"{where} ignores $instance: {expr}"


def test_stat_panels_have_thresholds() -> None:
    stats = [p for p in _panels() if p["type"] == "stat"]
    assert len(stats) >= 8
    for p in stats:
        steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert len(steps) >= 2, p["title"]
        assert steps[0]["value"] is None and all(s["value"] is not None for s in steps[1:]), p[
            "title"
        ]


def test_health_comes_from_up_and_exporter_up_is_never_no_data() -> None:
    stats = {p["title"]: _exprs(p) for p in _panels() if p["type"] == "stat"}
    assert any('up{job="payment-worker"}' in e for exprs in stats.values() for e in exprs)
    (exporter_up,) = stats["Exporter up"]
    assert 'up{job="payment-worker-exporter"}' in exporter_up
    assert "payment_worker_exporter_up" in exporter_up
    # with the exporter gone both series vanish: the fallback keeps the stat at 0
    assert exporter_up.rstrip().endswith("or vector(0)")


def test_429_401_and_lock_figures_have_panels_of_their_own() -> None:
    own = [
        "payment_worker_gateway_rate_limited_total",
        "payment_worker_gateway_unauthorized_total",
        "payment_worker_lock_contention_total",
        "payment_worker_lock_lost_total",
        "payment_worker_fencing_rejections_total",
        "payment_worker_lock_renewals_total",
    ]
    for name in own:
        panels = [p for p in _panels() if any(name in e for e in _exprs(p))]
        assert panels, f"{name} is on no panel"
        for p in panels:
            others = {m for e in _exprs(p) for m in metric_tokens(e)} & set(own) - {name}
            assert not others, f"{p['title']} mixes {name} with {sorted(others)}"


def test_gateway_latency_shows_p50_and_p99() -> None:
    exprs = [
        e
        for _, e in dashboard_expressions()
        if "payment_worker_gateway_request_seconds_bucket" in e
    ]
    assert any(e.startswith("histogram_quantile(0.5,") for e in exprs)
    assert any(e.startswith("histogram_quantile(0.99,") for e in exprs)


def test_panels_have_unique_ids_and_fit_the_grid() -> None:
    panels = _panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_metrics_doc_lists_every_metric_with_its_type() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`(payment_worker_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    for name, fam in all_families().items():
        assert name in rows, f"docs/metrics.md has no row for {name}"
        assert rows[name] == fam.kind, f"{name}: docs say {rows[name]}, it is a {fam.kind}"


def test_exporter_up_stat_evaluates_to_0_when_the_exporter_is_gone(tmp_path: Path) -> None:
    # the stat's real expression, evaluated by promtool over input series for each case
    (expr,) = next(_exprs(p) for p in _panels() if p["title"] == "Exporter up")
    rules = {"groups": [{"name": "stat", "rules": [{"record": "exporter_up_stat", "expr": expr}]}]}
    (tmp_path / "stat.yml").write_text(yaml.safe_dump(rules))
    up = 'up{job="payment-worker-exporter", instance="exporter:9809"}'
    read = 'payment_worker_exporter_up{job="payment-worker-exporter", instance="exporter:9809"}'
    cases = {
        "healthy": ([(up, "1x5"), (read, "1x5")], 1),
        "cannot read Postgres": ([(up, "1x5"), (read, "0x5")], 0),
        "target down (its series go stale)": ([(up, "0x5")], 0),
        "never scraped at all": ([('up{job="payment-worker", instance="w:9810"}', "1x5")], 0),
    }
    tests = [
        {
            "name": name,
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series],
            "promql_expr_test": [
                {
                    "expr": "exporter_up_stat",
                    "eval_time": "3m",
                    "exp_samples": [{"labels": "exporter_up_stat", "value": want}],
                }
            ],
        }
        for name, (series, want) in cases.items()
    ]
    (tmp_path / "stat-tests.yml").write_text(
        yaml.safe_dump({"rule_files": ["stat.yml"], "tests": tests})
    )
    proc = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "stat-tests.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
