"""The Celery application.

``celery -A payment_worker worker|beat`` finds it as ``payment_worker.app``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_init, worker_process_init

app = Celery("payment_worker", include=["payment_worker.worker.tasks"])
# lazy: the config module (and with it any embedded server) loads on first use
app.config_from_object("payment_worker.worker.celery_config")


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # a forked pool child must not share its parent's database sockets
    from payment_worker.db.engine import dispose_engines

    dispose_engines()


@worker_init.connect
def _worker_init(**_: Any) -> None:
    # structured logs, and this worker process's /metrics on METRICS_PORT (0: off)
    from payment_worker.ops.logging import configure_logging, get_logger
    from payment_worker.settings import get_settings

    s = get_settings()
    configure_logging(s.log_level, s.log_json)
    if s.metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(s.metrics_port)
        except OSError as exc:
            # several workers on one host: give each its own METRICS_PORT
            get_logger("worker").warning("metrics_port_busy", port=s.metrics_port, error=str(exc))
