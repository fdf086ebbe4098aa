"""A small end-to-end run with a real worker whose stdout and stderr are kept apart, for the
log-stream and secret-scan tests: batches with paid, declined (the simulator echoes the
account number) and dead (503s echoing it) items."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from payment_worker import runtime
from payment_worker.db.work import open_counts
from tests.conftest import ROOT

# echoed by the simulator: bank_code BLOCKED (402) and UNAVAILABLE (503)
DECLINED_NUMBER = "8142003917365524"
DEAD_NUMBER = "6620 1984 7730 0412"
PAID_NUMBER = "3300991177"


def batches(prefix: str, accounts: int = 2) -> list[dict[str, Any]]:
    """Per account: one batch of 3 paid, 1 declined (echoing), 1 dead (503s echoing)."""
    out = []
    for a in range(accounts):
        items = [
            {
                "transaction_id": f"{prefix}-a{a}-paid-{i}",
                "amount": 1000 + i,
                "currency": "IDR",
                "beneficiary": {"bank_code": "008", "account_number": PAID_NUMBER, "name": "P"},
            }
            for i in range(3)
        ]
        items.append(
            {
                "transaction_id": f"{prefix}-a{a}-declined",
                "amount": 2000,
                "currency": "IDR",
                "beneficiary": {
                    "bank_code": "BLOCKED",
                    "account_number": DECLINED_NUMBER,
                    "name": "D",
                },
            }
        )
        items.append(
            {
                "transaction_id": f"{prefix}-a{a}-dead",
                "amount": 3000,
                "currency": "IDR",
                "beneficiary": {
                    "bank_code": "UNAVAILABLE",
                    "account_number": DEAD_NUMBER,
                    "name": "X",
                },
            }
        )
        out.append(
            {"batch_id": f"{prefix}-batch-{a}", "account_id": f"{prefix}-acct-{a}", "items": items}
        )
    return out


def worker_env(base: dict[str, str]) -> dict[str, str]:
    """Fast retries (the dead item dies after two 503s), no metrics port, JSON by auto."""
    env = {**base}
    env.pop("LOG_JSON", None)  # auto: stderr is a file, not a terminal
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "METRICS_PORT": "0",
            "RETRY_MAX_ATTEMPTS": "2",
            "RETRY_BASE_DELAY": "0.2",
            "RETRY_MAX_DELAY": "1",
            "SWEEPER_INTERVAL": "2",
        }
    )
    return env


@dataclass
class Worker:
    """A running ``celery -A payment_worker worker`` with stdout and stderr in two files."""

    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path


@contextmanager
def celery_worker(env: dict[str, str], workdir: Path, name: str = "w1") -> Iterator[Worker]:
    """A threads-pool worker on queues payments and dlq; warm shutdown at the end."""
    out, err = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "payment_worker",
        "worker",
        "-Q",
        "payments,dlq",
        "-P",
        "threads",
        "-c",
        "2",
        "-n",
        f"{name}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(
            argv, env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, cwd=ROOT
        )
        try:
            yield Worker(proc, out, err)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def wait_terminal(total: int, timeout: float, worker: Worker | None = None) -> dict[str, int]:
    """Poll Postgres until ``total`` transactions are terminal; the counts."""
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        if worker is not None and worker.proc.poll() is not None:
            raise AssertionError(f"worker exited: {worker.stderr.read_text()[-3000:]}")
        with runtime.current().engine.connect() as conn:
            counts = open_counts(conn)
        if sum(counts.get(s, 0) for s in ("succeeded", "failed", "dead")) >= total:
            return counts
        time.sleep(0.3)
    raise AssertionError(f"not all {total} items terminal after {timeout}s: {counts}")


def cli(
    env: dict[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m payment_worker.cli ARGS`` with ``env``; output captured (never a TTY)."""
    return subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line parsed as one JSON object (an AssertionError names the first that is not)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"line {n} is not JSON: {line[:300]!r}") from None
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def submit(
    env: dict[str, str], data: list[dict[str, Any]], path: Path
) -> subprocess.CompletedProcess[str]:
    """``payment-worker submit FILE``."""
    path.write_text(json.dumps(data))
    proc = cli(env, "submit", str(path))
    assert proc.returncode == 0, proc.stderr
    return proc


def environ() -> dict[str, str]:
    """This process's environment (the test's URLs, set by the pw_env fixture)."""
    return dict(os.environ)


@dataclass
class Simulator:
    """A simulator process with its output in a file."""

    url: str
    proc: subprocess.Popen[bytes]
    output: Path


@contextmanager
def simulator(env: dict[str, str], workdir: Path, *flags: str) -> Iterator[Simulator]:
    """``payment-worker gateway-sim`` on a free port, its stdout and stderr in one file."""
    from payment_worker.dev.local_cluster import free_port

    port = free_port()
    out = workdir / "gateway-sim.out"
    argv = [sys.executable, "-m", "payment_worker.cli", "gateway-sim", "--port", str(port)]
    with open(out, "wb") as fo:
        proc = subprocess.Popen(
            [*argv, *flags],
            env={**env, "PYTHONPATH": str(ROOT)},
            stdout=fo,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while b"listening on" not in out.read_bytes():
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
                time.sleep(0.05)
            yield Simulator(url, proc, out)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
