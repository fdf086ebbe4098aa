"""A worker raises its soft limit of open files to the hard one at start.

Found measuring issue 13's scenario 5: a threads worker at the default concurrency held
about 1,000 files at 1 s gateway latency, the soft limit many systems give a process, past
which every new socket fails with EMFILE. Here the worker is started with a soft limit of
256 (inherited from this process) and must run with its hard limit instead.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from payment_worker.dev.local_cluster import LocalCluster
from payment_worker.worker.celery_app import app
from tests.conftest import PwEnv, wait_until

LOW = 256


@contextmanager
def _soft_limit(value: int) -> Iterator[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _limits(pid: int) -> tuple[str, str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no open files line")


def test_worker_raises_its_open_files_limit(pw_env: PwEnv, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_POOL", "WORKER_CONCURRENCY")}
    env.update({"METRICS_PORT": "0", "LOG_LEVEL": "WARNING"})
    with (
        _soft_limit(LOW) as hard,
        LocalCluster(workdir=tmp_path, env=env, pool=None, concurrency=None) as cluster,
    ):
        worker = cluster.start_worker()
        # the limit is raised at worker_init, before the consumer answers a ping
        wait_until(lambda: len(app.control.ping(timeout=0.5)) == 1, 60, "worker up")
        soft_now, hard_now = _limits(worker.pid)
    want = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    assert (soft_now, hard_now) == (want, want)
    assert hard == resource.RLIM_INFINITY or hard > LOW  # else the test proves nothing
