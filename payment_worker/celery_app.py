"""The Celery application.

``celery -A payment_worker worker|beat`` finds it as ``payment_worker.app``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_process_init

app = Celery("payment_worker", include=["payment_worker.tasks"])
# lazy: the config module (and with it any embedded server) loads on first use
app.config_from_object("payment_worker.celery_config")


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # a forked pool child must not share its parent's database sockets
    from payment_worker.db.engine import dispose_engines

    dispose_engines()
