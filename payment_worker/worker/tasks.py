"""Thin Celery tasks: the logic lives in processing.py and sweeper.py."""

from __future__ import annotations

from payment_worker.worker.celery_app import app

PROCESS_TASK = "payment_worker.process_account_batch"


@app.task(name=PROCESS_TASK, bind=False)
def process_account_batch(batch_id: str) -> None:
    """Take one account's batch through the state machine (queue ``payments``)."""
    from payment_worker.worker.drain import run_batch_task

    run_batch_task(batch_id)


@app.task(name="payment_worker.sweep")
def sweep() -> None:
    """Beat's periodic repair: re-enqueue stalled batches, resolve stuck items."""
    from payment_worker.worker.sweeper import run_sweep

    run_sweep()


def enqueue_batch(batch_id: str, countdown: float | None = None) -> None:
    """Publish one ``process_account_batch`` message carrying only the batch id.

    Raises the broker's error when it is unreachable; callers that have persisted the batch
    already may ignore it, because the sweeper enqueues pending batches.
    """
    process_account_batch.apply_async(
        args=[batch_id], queue="payments", routing_key="payments", countdown=countdown
    )
