"""The metric definitions: multiprocess-safe gauges, label values pre-set to zero (and
covering what the code really emits), the worker detection, a killed pool process's live
gauges dropped, and the delayed-message reading of the broker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import Gauge
from prometheus_client.metrics import MetricWrapperBase

from payment_worker.ops import metrics, queue_depth
from payment_worker.ops.multiprocess import SINGLE_PROCESS_POOLS, celery_subcommand, worker_pool

PKG = Path(__file__).resolve().parents[2] / "payment_worker"


def _metrics() -> list[MetricWrapperBase]:
    return [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]


def test_every_gauge_has_a_multiprocess_mode() -> None:
    # the default, "all", exports one series per pid: unbounded under prefork's recycling
    for m in _metrics():
        if isinstance(m, Gauge):
            assert m._multiprocess_mode not in ("all", "liveall"), m._name


def test_label_values_alerts_use_exist_at_zero() -> None:
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    for reason in ("expired", "stolen", "unreachable", "deadline", "stalled"):
        assert value("payment_worker_lock_lost_total", reason=reason) is not None
    for endpoint in ("create", "lookup"):
        assert value("payment_worker_gateway_unauthorized_total", endpoint=endpoint) is not None
        assert value("payment_worker_gateway_rate_limited_total", endpoint=endpoint) is not None
        assert (
            value("payment_worker_gateway_requests_total", endpoint=endpoint, outcome="unknown")
            is not None
        )
    for reason in ("retries_exhausted", "unknown_unresolved", "task_crashed"):
        assert value("payment_worker_dead_letters_total", reason=reason) is not None
    for result in ("processed", "fenced_out", "lock_lost"):
        assert value("payment_worker_task_executions_total", result=result) is not None
    assert value("payment_worker_fencing_rejections_total") is not None


def _literals(path: Path, pattern: str) -> set[str]:
    return set(re.findall(pattern, path.read_text()))


def test_presets_cover_what_the_code_emits() -> None:
    # the reasons a lock is marked lost, the results a drain reports, the endpoints called
    calls = re.findall(
        r"_mark_lost\(\s*\w+,([^,)]*)", (PKG / "locks" / "account_lock.py").read_text()
    )
    lost = {word for call in calls for word in re.findall(r'"(\w+)"', call)}
    assert lost and lost <= set(metrics.LOCK_LOST_REASONS)
    results = _literals(PKG / "worker" / "drain.py", r'result(?: = |: str = |=)"(\w+)"')
    assert results and results <= set(metrics.TASK_RESULTS)
    endpoints = _literals(PKG / "gateway" / "client.py", r'self\._call\(\s*"(\w+)"')
    assert endpoints == set(metrics.GATEWAY_ENDPOINTS)


@pytest.mark.parametrize(
    ("argv", "sub"),
    [
        (["/venv/bin/celery", "-A", "payment_worker", "worker", "-P", "prefork"], "worker"),
        (["/x/site-packages/celery/__main__.py", "--app=payment_worker", "worker"], "worker"),
        (["/venv/bin/celery", "-b", "redis://h", "-q", "-A", "payment_worker", "beat"], "beat"),
        (["/venv/bin/celery", "-A", "payment_worker", "dlq", "list"], "dlq"),
        (["/venv/bin/payment-worker", "worker"], None),
        (["/venv/bin/celery", "--version"], None),
        ([], None),
    ],
)
def test_the_celery_subcommand_is_read_from_the_command_line(
    argv: list[str], sub: str | None
) -> None:
    assert celery_subcommand(argv) == sub


@pytest.mark.parametrize(
    ("argv", "environ", "pool"),
    [
        (["celery", "-A", "payment_worker", "worker"], {}, "threads"),  # the default
        (["celery", "-A", "payment_worker", "worker"], {"WORKER_POOL": " Prefork "}, "prefork"),
        (["celery", "-A", "payment_worker", "worker"], {"worker_pool": "solo"}, "solo"),
        (["celery", "-A", "payment_worker", "worker", "-P", "prefork"], {}, "prefork"),
        (["celery", "worker", "--pool=threads"], {"WORKER_POOL": "prefork"}, "threads"),
    ],
)
def test_the_pool_decides_whether_metrics_go_through_files(
    argv: list[str], environ: dict[str, str], pool: str
) -> None:
    # only a forking pool needs the multiprocess mode (and its one lock per process)
    assert worker_pool(argv, environ) == pool
    assert (pool in SINGLE_PROCESS_POOLS) == (pool != "prefork")


_CHILD = """
import os, sys, time
from payment_worker.ops import metrics
metrics.IN_PROGRESS.inc()
metrics.TRANSACTIONS_FINISHED.labels("succeeded").inc(3)
print("ready", flush=True)
time.sleep(60)
"""

_SCRAPE = """
from prometheus_client import generate_latest
from payment_worker.ops import metrics
print(generate_latest(metrics._worker_registry()).decode())
"""


def _scrape(env: dict[str, str], *prefixes: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _SCRAPE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    found = {}
    for line in out.stdout.splitlines():
        wanted = ("payment_worker_batches_in_progress ", "payment_worker_transactions_f", *prefixes)
        if line.startswith(wanted):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def test_a_killed_pool_process_stops_counting_as_busy_but_its_counts_stay(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        busy = _scrape(env)
        assert busy["payment_worker_batches_in_progress"] == 1
        os.kill(child.pid, signal.SIGKILL)  # no shutdown hook runs
        child.wait(timeout=10)
        after = _scrape(env)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert after["payment_worker_batches_in_progress"] == 0
    assert after['payment_worker_transactions_finished_total{status="succeeded"}'] == 3


def _unacked(eta: datetime | None) -> bytes:
    headers = {"task": "payment_worker.process_account_batch", "eta": eta and eta.isoformat()}
    return json.dumps([{"body": "", "headers": headers}, "payments", "payments"]).encode()


def test_delayed_messages_are_the_unacked_ones_still_due_later() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert queue_depth._eta(_unacked(now + timedelta(seconds=30))) == now + timedelta(seconds=30)
    assert queue_depth._eta(_unacked(None)) is None  # a running task, not a delayed one
    assert queue_depth._eta(b"not json") is None
    assert queue_depth.queue_keys("payments") == [
        "payments",
        "payments\x06\x163",
        "payments\x06\x166",
        "payments\x06\x169",
    ]


_ENDED_CHILD = """
from payment_worker.ops import metrics
metrics.TRANSACTIONS_FINISHED.labels("failed").inc(2)
metrics.BATCH_SECONDS.observe(0.07)
metrics.BATCH_SECONDS.observe(3.0)
"""


def test_ended_processes_are_folded_into_one_archive_and_still_counted(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(3):  # three pool children that each ran and ended (recycled)
        done = subprocess.run([sys.executable, "-c", _ENDED_CHILD], env=env, timeout=60)
        assert done.returncode == 0
    children = sorted(tmp_path.glob("counter_*.db"))
    assert len(children) == 3
    first = _scrape(env, "payment_worker_batch_processing_seconds")
    # one archive per type instead of a file per ended child
    assert sorted(p.name for p in tmp_path.glob("*.db") if "archive" in p.name) == [
        "counter_archive.db",
        "histogram_archive.db",
    ]
    assert not [p for p in children if p.exists()]
    # another child ends; the archive grows, nothing is lost or counted twice
    assert subprocess.run([sys.executable, "-c", _ENDED_CHILD], env=env, timeout=60).returncode == 0
    second = _scrape(env, "payment_worker_batch_processing_seconds")
    failed = 'payment_worker_transactions_finished_total{status="failed"}'
    assert first[failed] == 6 and second[failed] == 8
    assert first["payment_worker_batch_processing_seconds_count"] == 6
    assert second["payment_worker_batch_processing_seconds_count"] == 8
    assert second['payment_worker_batch_processing_seconds_bucket{le="0.1"}'] == 4
    assert second['payment_worker_batch_processing_seconds_bucket{le="+Inf"}'] == 8
    assert second["payment_worker_batch_processing_seconds_sum"] == pytest.approx(4 * 3.07)


_PREPARE = """
import os, sys
sys.argv = ["celery", "-A", "payment_worker", "worker", "-P", "prefork"]
from payment_worker.ops.multiprocess import prepare_worker
print(prepare_worker(), os.getpid())
"""


def _prepare(env: dict[str, str]) -> tuple[Path, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PREPARE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    path, pid = out.stdout.split()
    return Path(path), int(pid)


def test_a_worker_started_again_by_detach_makes_its_own_directory(tmp_path: Path) -> None:
    """``--detach`` (and ``celery multi``) forks and execs the worker again with the same
    environment: before, the new process took the directory its first process had made for
    one an operator gave, named after that first process, which is gone; the next worker to
    start on the host deleted it as stale under the running one (a review found it)."""
    from payment_worker.ops.multiprocess import _OWNED_ENV, ENV

    env = {k: v for k, v in os.environ.items() if k not in (ENV, _OWNED_ENV)}
    env["TMPDIR"] = str(tmp_path)
    first, first_pid = _prepare(env)  # the first process: its own directory, named by pid
    assert first.name == str(first_pid) and not first.exists()  # removed as it ended
    first.mkdir(parents=True)
    again, pid = _prepare({**env, ENV: str(first), _OWNED_ENV: str(first)})
    assert again == first.parent / str(pid) and again != first
    # a directory an operator gave is used as given
    given = tmp_path / "given"
    assert _prepare({**env, ENV: str(given)})[0] == given
