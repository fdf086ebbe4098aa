"""The commands meet a database or Redis that is down, or a schema that is not there: one line
naming the problem and exit code 1, never a traceback, and never a batch's beneficiaries
(SQLAlchemy's error text goes on with the statement's parameters)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from payment_worker.db import migrate
from tests.conftest import ROOT, PwEnv

SAMPLE = str(ROOT / "payment_worker" / "dev" / "sample-batch.json")


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def _problem_lines(stderr: str) -> list[str]:
    """stderr without the JSON log records a command may write before it stops."""
    return [line for line in stderr.splitlines() if line and not line.startswith("{")]


@pytest.mark.parametrize(
    "args",
    [("db", "upgrade"), ("sweep",), ("submit", SAMPLE), ("status", "--all")],
    ids=["db-upgrade", "sweep", "submit", "status"],
)
def test_a_database_that_is_down_is_one_line_and_exit_1(
    pw_env: PwEnv, closed_port: int, args: tuple[str, ...]
) -> None:
    down = f"postgresql://postgres@127.0.0.1:{closed_port}/nothing"
    proc = run(*args, env={"DATABASE_URL": down})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    problem = _problem_lines(proc.stderr)
    assert len(problem) == 1, proc.stderr
    assert "database error" in problem[0]
    assert "Connection refused" in problem[0] or "connection failed" in problem[0]


def test_redis_that_is_down_is_one_line_and_exit_1(pw_env: PwEnv, closed_port: int) -> None:
    proc = run("sweep", env={"REDIS_URL": f"redis://127.0.0.1:{closed_port}/0"})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    problem = _problem_lines(proc.stderr)
    assert len(problem) == 1, proc.stderr
    assert problem[0].startswith("payment-worker: Redis error:")


def test_a_schema_that_is_not_there_says_what_to_run_and_shows_no_beneficiary(
    pw_env: PwEnv,
) -> None:
    url = pw_env.database_url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate.downgrade(url, "base")
    proc = run("submit", SAMPLE, env={})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    problem = _problem_lines(proc.stderr)
    assert len(problem) == 1, proc.stderr
    assert 'relation "batches" does not exist' in problem[0]
    assert "run `payment-worker db upgrade`" in problem[0]
    # the statement's parameters (the batch's rows) are not shown
    assert "account_number" not in proc.stderr
    assert "1234560001" not in proc.stderr

    # and the upgrade it names makes the same submission go through
    assert run("db", "upgrade", env={}).returncode == 0
    again = run("submit", SAMPLE, env={})
    assert again.returncode == 0, again.stderr


def test_an_exporter_port_in_use_is_one_line_and_exit_1(pw_env: PwEnv) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run("exporter", "--host", "127.0.0.1", "--port", str(port), env={})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    problem = _problem_lines(proc.stderr)
    assert len(problem) == 1, proc.stderr
    assert problem[0].startswith(
        f"payment-worker exporter: cannot serve metrics on 127.0.0.1:{port}"
    )


@pytest.mark.parametrize("port", ["0", "70000", "x"])
def test_an_exporter_port_out_of_range_is_a_usage_error(pw_env: PwEnv, port: str) -> None:
    proc = run("exporter", "--port", port, env={})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--port" in proc.stderr
