"""deploy/alerts.yml: valid for promtool, its unit tests pass, every alert is tested firing and
not firing, uses only real metrics, and links its runbook section; docs/metrics.md explains it.

promtool is Debian's prometheus package (.ci/run installs it); without it these tests skip,
except in CI where they fail.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability import (
    ALERT_TESTS,
    ALERTS,
    ROOT,
    alert_rules,
    metric_tokens,
    promtool,
    sample_names,
)

# the alert names every helper agreed on (docs/runbook.md has a "## <name>" section each)
ALERT_NAMES = {
    "PaymentWorkerDown",
    "PaymentQueueBackingUp",
    "PaymentNoProgress",
    "PaymentInDoubtTooOld",
    "PaymentAccountStalled",  # added with transactions.unsent_since (migration 0007)
    "PaymentDeadLettersOpened",
    "PaymentFencingRejections",
    "PaymentLockLost",
    "PaymentGatewayErrorRatioHigh",
    "PaymentGatewayUnauthorized",
    "PaymentExporterDown",
}
RUNBOOK = ROOT / "docs" / "runbook.md"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_accepts_the_rules_and_the_prometheus_config() -> None:
    tool = promtool()
    proc = _run(tool, "check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in proc.stdout
    # the config loads the same rules file (rule_files is relative to the config file)
    proc = _run(tool, "check", "config", str(PROMETHEUS_CONFIG))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "alerts.yml" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = _run(promtool(), "test", "rules", str(ALERT_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    # the tests are not vacuous: a rule with a wrong threshold makes them fail
    tool = promtool()
    broken = ALERTS.read_text().replace(
        "max(last_over_time(payment_worker_oldest_in_doubt_age_seconds[3m])) > 600",
        "max(last_over_time(payment_worker_oldest_in_doubt_age_seconds[3m])) > 90000",
    )
    assert broken != ALERTS.read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts-tests.yml").write_text(ALERT_TESTS.read_text())
    proc = _run(tool, "test", "rules", str(tmp_path / "alerts-tests.yml"))
    assert proc.returncode != 0
    assert "PaymentInDoubtTooOld" in proc.stdout + proc.stderr


def test_the_agreed_alerts_exist_with_severity_and_annotations() -> None:
    rules = alert_rules()
    assert sorted(r["alert"] for r in rules) == sorted(ALERT_NAMES)
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert notes["runbook_url"] == f"docs/runbook.md#{rule['alert'].lower()}"


def test_rules_use_only_metrics_the_service_exposes() -> None:
    known = sample_names()
    for rule in alert_rules():
        used = metric_tokens(rule["expr"])
        assert used <= known, f"{rule['alert']}: unknown {sorted(used - known)}"
    # jobs named in the rules are the jobs of deploy/prometheus.yml
    jobs = {j["job_name"] for j in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    for rule in alert_rules():
        assert set(re.findall(r'job="([^"]+)"', rule["expr"])) <= jobs, rule["alert"]


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        assert case["input_series"], case["name"]
        for check in case["alert_rule_test"]:
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
            for alert in check.get("exp_alerts") or []:
                # the annotations are checked too: the rendered text is what on-call reads
                assert alert["exp_annotations"]["runbook_url"].endswith(check["alertname"].lower())
    assert firing == ALERT_NAMES, f"never seen firing: {sorted(ALERT_NAMES - firing)}"
    assert quiet == ALERT_NAMES, f"never checked quiet: {sorted(ALERT_NAMES - quiet)}"


def test_runbook_has_a_section_per_alert() -> None:
    if not RUNBOOK.exists():
        pytest.skip(
            "docs/runbook.md not written yet (issue 16's runbook); the links are checked then"
        )
    text = RUNBOOK.read_text()
    headings = {m.strip() for m in re.findall(r"^## (.+)$", text, re.M)}
    missing = ALERT_NAMES - headings
    assert not missing, f"docs/runbook.md lacks a '## <AlertName>' section for {sorted(missing)}"


def test_metrics_doc_explains_every_alert_with_its_runbook_link() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    for name in ALERT_NAMES:
        rows = [line for line in text.splitlines() if f"`{name}`" in line and line.startswith("|")]
        assert rows, f"docs/metrics.md has no table row for {name}"
        assert f"(runbook.md#{name.lower()})" in rows[0], f"{name}: no runbook link in its row"
