"""When a missing service skips the integration tests and when it fails them.

A skip hides whatever it skips: it is right for a server the environment names (a URL) that
is down on a developer's machine, and wrong for the embedded servers, which our own code
starts: if that breaks, the integration tests must fail, not quietly disappear.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, service_verdict

DOWN = ConnectionRefusedError(111, "Connection refused")


@pytest.mark.parametrize("service", ["PostgreSQL", "Redis"])
@pytest.mark.parametrize(
    ("url_set", "installed", "ci", "verdict"),
    [
        (True, True, False, "skip"),  # a URL to a server that is down: the environment
        (True, False, False, "skip"),
        (True, True, True, "fail"),  # CI never skips
        (False, True, False, "fail"),  # the embedded server did not start: our code
        (False, True, True, "fail"),
        (False, False, False, "skip"),  # no URL and no embedded extra: the environment
        (False, False, True, "fail"),
    ],
)
def test_service_verdict(
    service: str, url_set: bool, installed: bool, ci: bool, verdict: str
) -> None:
    got, message = service_verdict(
        service, DOWN, url_set=url_set, embedded_installed=installed, ci=ci
    )
    assert got == verdict
    # the message names the service and carries the error, whatever the verdict
    assert f"{service}: ConnectionRefusedError: " in message and "Connection refused" in message


def test_embedded_failure_message_says_it_is_a_bug() -> None:
    error = RuntimeError("initdb exited with code 1")
    verdict, message = service_verdict(
        "PostgreSQL", error, url_set=False, embedded_installed=True, ci=False
    )
    assert verdict == "fail"
    assert "DATABASE_URL unset" in message and "a bug, not the environment" in message
    assert "RuntimeError: initdb exited with code 1" in message


# The fixture itself, in a pytest of its own: a probe test that needs the services.
PROBE = """
def test_probe(service_urls):
    pass
"""


def _run_probe(tmp_path: Path, env: dict[str, str | None]) -> subprocess.CompletedProcess[str]:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, value in env.items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    # the probe lies outside tests/, so the fixtures come in as a plugin
    args = ["-q", "-rs", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--rootdir", str(tmp_path), str(probe)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full,
        timeout=120,
    )


def test_urls_of_servers_that_are_down_skip_locally(tmp_path: Path, closed_port: int) -> None:
    proc = _run_probe(
        tmp_path,
        {
            "CI": None,
            "DATABASE_URL": f"postgresql://u@127.0.0.1:{closed_port}/db",
            "REDIS_URL": f"redis://127.0.0.1:{closed_port}/0",
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout and "service unavailable: PostgreSQL" in proc.stdout


def test_embedded_servers_that_cannot_start_fail_the_tests(tmp_path: Path) -> None:
    pytest.importorskip("pgserver")  # the extra is installed: starting it is our code's job
    home = tmp_path / "home"
    home.write_text("a file where the embedded servers' folder should be")
    proc = _run_probe(
        tmp_path,
        {"CI": None, "DATABASE_URL": None, "REDIS_URL": None, "PAYMENT_WORKER_HOME": str(home)},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 error" in proc.stdout and "skipped" not in proc.stdout
    assert "the embedded server did not start or answer (DATABASE_URL unset" in proc.stdout
