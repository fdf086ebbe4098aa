"""``payment-worker demo`` from the command line, as a newcomer runs it (a small size).

Each run is a real subprocess on the test's database and Redis (the URLs are set, so the
demo uses those servers): it must exit 0, report 0 double payments and nothing lost in its
JSON report and in its stable text lines, keep logs off the terminal, and leave nothing
running (every process it starts carries ``PW_DEMO_RUN=<run id>`` in its environment, so
/proc tells). Ctrl-C and SIGTERM in the middle of a run must stop everything too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from payment_worker.dev.demo import marked
from tests.conftest import PwEnv

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    # the run folder (logs, report) under the test's own home
    return {**os.environ, "PAYMENT_WORKER_HOME": str(tmp_path / "home")}


def _demo(tmp_path: Path, *flags: str, timeout: float = 150) -> tuple[int, str, str, Any]:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", "demo", *flags, "--json-report", str(report)],
        env=_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    data = json.loads(report.read_text()) if report.exists() else None
    return done.returncode, done.stdout, done.stderr, data


def _assert_clean_run(rc: int, out: str, err: str, data: Any, items: int) -> None:
    assert rc == 0, out + err
    assert data is not None, out + err
    assert data["double_payments"] == 0 and data["double_paid"] == []
    assert data["lost"] == 0 and data["not_final"] == 0
    assert data["reconciliation"]["ok"] is True
    assert sum(data["final"].values()) == data["items"] == items
    # the stable lines a person or a CI job greps for
    assert re.search(r"^double payments: 0$", out, re.M), out
    assert re.search(r"^lost: 0$", out, re.M), out
    # both refusals were made and shown with their reason
    assert sorted(r["status"] for r in data["refused"]) == ["duplicate", "rejected"]
    assert "already exists in batch" in out
    # quiet: no log line of any process reached the terminal, nothing on stderr
    assert err == ""
    for noise in ("alembic.runtime", "Context impl", "[info", "[warning", "INFO ", "component="):
        assert noise not in out, f"{noise!r} leaked to the terminal:\n{out}"
    # every process it started is gone
    assert marked(data["run_id"]) == []
    logs = {p.name for p in Path(data["run_dir"]).glob("*.log")}
    assert {"gateway-sim.log", "exporter.log", "worker1.log", "demo.log"} <= logs


def test_small_demo(pw_env: PwEnv, tmp_path: Path) -> None:
    rc, out, err, data = _demo(tmp_path, "--accounts", "3", "--items", "90", "--workers", "2")
    _assert_clean_run(rc, out, err, data, items=90)
    # the faults were on: the gateway refused or lost some sends, and every one was repaired
    assert data["retries_by_reason"], data
    assert data["final"]["failed"] >= 1  # the declined beneficiaries
    assert data["final"]["dead"] == 0
    assert data["tokens_issued_per_account"], data
    assert f"payment-worker status {data['batch_ids'][0]}" in out
    assert "celery -A payment_worker dlq list" in out


def test_demo_with_a_file(pw_env: PwEnv, tmp_path: Path) -> None:
    sample = ROOT / "payment_worker" / "dev" / "sample-batch.json"
    rc, out, err, data = _demo(tmp_path, str(sample), "--workers", "1")
    _assert_clean_run(rc, out, err, data, items=30)
    assert all(b.endswith(f"-{data['run_id']}") for b in data["batch_ids"]), data["batch_ids"]
    # the file's accounts under the demo's prefix only: never a real account's lock or token
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        accounts = {
            str(r[0])
            for r in conn.execute(
                "SELECT DISTINCT account_id FROM batches WHERE batch_id LIKE %s",
                (f"%-{data['run_id']}",),
            )
        }
    assert accounts == {"demo-acct-42", "demo-acct-77"}, accounts


def test_small_chaos_demo(pw_env: PwEnv, tmp_path: Path) -> None:
    rc, out, err, data = _demo(
        tmp_path, "--chaos", "--accounts", "3", "--items", "150", "--workers", "2"
    )
    _assert_clean_run(rc, out, err, data, items=150)
    events = "\n".join(data["chaos_events"])
    # a lock holder was killed (and replaced), and one was paused past the lock TTL
    assert "SIGKILL" in events and "started" in events, events
    assert "SIGSTOP" in events and "SIGCONT" in events, events


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_demo_leaves_nothing_running(
    pw_env: PwEnv, tmp_path: Path, sig: signal.Signals
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "payment_worker.cli", "demo", "--accounts", "2", "--items", "400"],
        env=_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a background job of a shell without job control starts it (a CI
        # runner's): SIGINT ignored, which the command must undo (cli/common.py)
        preexec_fn=_ignore_sigint,
    )
    assert proc.stdout is not None
    run_id = None
    lines: list[str] = []
    deadline = time.monotonic() + 90
    # interrupt once the batches are in: the workers are up and paying
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"\(run (\S+)\)", line)
        run_id = m.group(1) if m else run_id
        if line.lstrip().startswith("submit"):
            break
    assert run_id is not None and lines[-1].lstrip().startswith("submit"), "".join(lines)
    assert marked(run_id), "the demo's processes should be running now"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(lines) + out + err
    assert "interrupted" in out
    assert marked(run_id) == []
