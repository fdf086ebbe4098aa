"""The Celery application.

``celery -A payment_worker worker|beat`` finds it as ``payment_worker.app``. Its configuration
is built from the settings when Celery first needs it, and each worker process builds its
:class:`~payment_worker.runtime.Runtime` at start: importing this module starts nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from celery import Celery
from celery.signals import worker_init, worker_process_init

from payment_worker import runtime
from payment_worker.embedded import EmbeddedError
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
    return build_config(rt.settings, rt.urls.broker)


# lazy: evaluated when Celery loads its configuration (a worker's start, the first publish)
app.add_defaults(_config)


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # a forked pool child builds its own clients now, not on its first task: it must never
    # share its parent's sockets
    runtime.current()


@worker_init.connect
def _worker_init(**_: Any) -> None:
    # structured logs, and this worker process's /metrics on METRICS_PORT (0: off)
    from payment_worker.ops.logging import configure_logging, get_logger

    s = runtime.current().settings
    configure_logging(s.log_level, s.log_json)
    if s.metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(s.metrics_port)
        except OSError as exc:
            # several workers on one host: give each its own METRICS_PORT
            get_logger("worker").warning("metrics_port_busy", port=s.metrics_port, error=str(exc))
