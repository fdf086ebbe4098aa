"""A task that does nothing but wait, for bench/celery_task.py (imported by its worker with
``-I _noop_task``)."""

from __future__ import annotations

import time

from payment_worker.worker.celery_app import app


@app.task(name="bench.noop", acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
def noop(seconds: float = 1.0) -> None:
    """Sleep ``seconds`` (a slot held as a gateway call at that latency would hold it)."""
    time.sleep(seconds)
