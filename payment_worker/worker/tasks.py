"""Thin Celery tasks: the logic lives in the drain loop and the sweeper."""

from __future__ import annotations

from celery import Task

from payment_worker import runtime
from payment_worker.worker import dlq  # the crash hooks and the dlq queue's task
from payment_worker.worker.celery_app import app
from payment_worker.worker.drain import run_batch_task
from payment_worker.worker.queueing import PROCESS_TASK, SWEEP_TASK
from payment_worker.worker.sweeper import run_sweep


@app.task(name=PROCESS_TASK, bind=True)
def process_account_batch(self: Task, batch_id: str) -> None:
    """Take one account's batch through the state machine (queue ``payments``)."""
    report = run_batch_task(batch_id, runtime.current())
    if report.result == "missing":
        # DLQ hook: a batch id that does not exist is a task_crashed dead letter
        dlq.record_missing_batch(batch_id, self.request.id)


@app.task(name=SWEEP_TASK)
def sweep() -> None:
    """Beat's periodic repair: re-enqueue stalled batches, resolve stuck items."""
    run_sweep(runtime.current())
