"""payment-worker: batch payouts, one account at a time, never twice, never lost."""

from __future__ import annotations

from typing import Any

from payment_worker.ops import multiprocess as _multiprocess

__all__ = ["app", "submit_batch"]
__version__ = "0.1.0"

# in `celery ... worker` only, and before anything imports prometheus_client: the worker's
# metrics in multiprocess mode when its pool forks (ops/multiprocess.py)
_multiprocess.prepare_worker()


def __getattr__(name: str) -> Any:
    # lazy, so that ``import payment_worker`` starts nothing and stays cheap
    if name in ("app", "celery"):
        from payment_worker.worker.celery_app import app

        return app
    if name == "submit_batch":
        from payment_worker.producer.submit import submit_batch

        return submit_batch
    raise AttributeError(name)
