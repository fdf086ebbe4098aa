"""Thin Celery tasks: the logic lives in the drain loop and the sweeper."""

from __future__ import annotations

from celery import Task
from structlog.contextvars import bind_contextvars

from payment_worker import runtime
from payment_worker.worker import dlq  # the crash hooks and the dlq queue's task
from payment_worker.worker.celery_app import app
from payment_worker.worker.drain import run_batch_task
from payment_worker.worker.queueing import ACCOUNT_HEADER, PROCESS_TASK, SWEEP_TASK
from payment_worker.worker.sweeper import sweep_if_due


@app.task(name=PROCESS_TASK, bind=True)
def process_account_batch(self: Task, batch_id: str, scheduled_due_ms: int | None = None) -> None:
    """Take one account's batch through the state machine (queue ``payments``).

    ``batch_id`` is the one positional argument producers and ops send. A delayed message
    of the drain loop also carries ``scheduled_due_ms`` (its marker's due time), so that its
    run clears the account's ``scheduled`` marker. (During a rolling upgrade a worker of an
    older version fails such a message, unexpected keyword: the sweeper re-enqueues the
    account once it is stale.)
    """
    bind_contextvars(batch_id=batch_id)  # cleared at task_postrun (worker/log_context.py)
    # the batch's account as the publisher wrote it in a header (worker/queueing.py)
    hint = self.request.get(ACCOUNT_HEADER)
    report = run_batch_task(
        batch_id,
        runtime.current(),
        scheduled_due_ms=scheduled_due_ms,
        account_id=hint if isinstance(hint, str) and hint else None,
    )
    if report.result == "missing":
        # DLQ hook: a batch id that does not exist is a task_crashed dead letter
        dlq.record_missing_batch(batch_id, self.request.id)


@app.task(name=SWEEP_TASK)
def sweep() -> None:
    """Beat's periodic repair, a fallback: every worker process sweeps in its own thread
    (worker/lifecycle.py); through the same gate, so the fleet sweeps about once per
    SWEEPER_INTERVAL either way."""
    sweep_if_due(runtime.current())
