"""The Celery application.

``celery -A payment_worker worker|beat`` finds it as ``payment_worker.app``. Its configuration
is built from the settings when Celery first needs it, and each worker process builds its
:class:`~payment_worker.runtime.Runtime` at start: importing this module starts nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from celery import Celery
from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)

from payment_worker import runtime
from payment_worker.embedded import EmbeddedError
from payment_worker.ops import multiprocess
from payment_worker.settings import SettingsError
from payment_worker.worker import log_context  # noqa: F401  Celery's logging through ours
from payment_worker.worker.celery_config import build_config

# imported by every worker (and beat): the tasks, and the receivers that run the sweeper
# thread beside the task slots (named here, not imported: no import cycle)
app = Celery(
    "payment_worker",
    include=["payment_worker.worker.tasks", "payment_worker.worker.lifecycle"],
)


def _config() -> dict[str, Any]:
    try:
        rt = runtime.current()
    except EmbeddedError as exc:
        # celery worker/beat: the same one line and exit code 2 as the payment-worker command
        print(f"payment-worker: {exc}", file=sys.stderr)
        raise SettingsError(2) from None
    return build_config(rt.settings, rt.urls.broker, sys.argv)


# lazy: evaluated when Celery loads its configuration (a worker's start, the first publish)
app.add_defaults(_config)


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # a forked pool child builds its own clients now, not on its first task: it must never
    # share its parent's sockets
    runtime.current()


@worker_init.connect
def _worker_init(**_: Any) -> None:
    # structured logs, and the worker's /metrics on METRICS_PORT (0: off) for all its pool
    # processes, served by this main process; a busy port ends the worker (one line)
    from payment_worker.ops.logging import configure_logging
    from payment_worker.ops.metrics import serve_worker_metrics

    s = runtime.current().settings
    configure_logging(s.log_level, s.log_json)
    serve_worker_metrics(s.metrics_port)


@worker_process_shutdown.connect
def _child_exit(pid: int | None = None, **_: Any) -> None:
    # a prefork child ends: its live gauges (batches in progress) stop counting
    from payment_worker.ops.metrics import process_exited

    process_exited(pid)


@worker_shutdown.connect
def _worker_shutdown(**_: Any) -> None:
    multiprocess.remove_owned_dir()
