"""A process that runs tasks freezes its heap once it is ready (worker/lifecycle.py): the
collector's full passes then walk what the tasks made, not the whole of Celery and
SQLAlchemy (issue 13: up to 177 ms of GIL each in a loaded worker before)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from payment_worker.dev.local_cluster import LocalCluster
from tests.conftest import PwEnv, logged_events, wait_until


def _frozen(log: Path) -> list[int]:
    return [int(str(e["objects"])) for e in logged_events(log, "heap_frozen")]


@pytest.mark.parametrize("pool", ["threads", "prefork", "solo"])
def test_the_process_that_runs_tasks_freezes_its_heap_once(
    pw_env: PwEnv, tmp_path: Path, pool: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_POOL", "WORKER_CONCURRENCY")}
    env.update({"WORKER_POOL": pool, "WORKER_CONCURRENCY": "2", "LOG_LEVEL": "INFO"})
    env.update({"LOG_JSON": "true", "METRICS_PORT": "0"})
    with LocalCluster(workdir=tmp_path, env=env, pool=None, concurrency=None) as cluster:
        worker = cluster.start_worker()
        # prefork: each of the two children freezes its own heap, the parent none; solo
        # sends both signals in its one process: frozen (and logged) once
        expected = 2 if pool == "prefork" else 1
        wait_until(lambda: len(_frozen(worker.log_path)) >= expected, 60, "heap_frozen logged")
        time.sleep(1.0)  # a second freeze, were there one, comes right after the first
    counts = _frozen(worker.log_path)
    assert len(counts) == expected, counts
    # the modules, Celery and the runtime: tens of thousands of objects, all frozen
    assert all(n > 20_000 for n in counts), counts
