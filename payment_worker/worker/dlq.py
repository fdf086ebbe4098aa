"""Crashed tasks become ``task_crashed`` dead letters.

A task that crashes outright (an exception escapes it, or ``process_account_batch`` names a
batch that does not exist), a message naming an unknown task, a message the worker cannot
decode, and one Celery rejects as invalid (``on_invalid_task``: arguments of the wrong shape,
an ETA that is no time) are written to ``dead_letters`` with what is known: the task name,
its arguments, the exception's class and message, and a digest of the traceback. The row is
written directly from the hook, in the worker, because Celery acks a failed task: nothing may
depend on the message surviving. Only when that write fails (Postgres unreachable) is the
record published to the ``dlq`` queue as ``payment_worker.dlq.record_crash``, which retries
until it can write.

The rows carry ``batch_pk`` when the named batch exists and nothing otherwise (migration 0004
allows that for ``task_crashed`` only); ``dlq list --reason task_crashed`` shows them and
``dlq resolve`` closes them (there is no transaction to replay).
"""

from __future__ import annotations

import hashlib
import time
import traceback as tb_mod
from types import TracebackType
from typing import Any

from celery import Task, bootsteps
from celery.exceptions import Reject
from celery.signals import task_failure, task_rejected, task_unknown
from celery.utils.time import get_exponential_backoff_interval

from payment_worker import runtime
from payment_worker.db.dead_letters import record_task_crash
from payment_worker.errors import PaymentWorkerError
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import DEAD_LETTERS
from payment_worker.ops.redaction import redact
from payment_worker.settings import DEAD_LETTER_RETRY_MAX_SECONDS
from payment_worker.worker.celery_app import app

log = get_logger("dlq")

RECORD_CRASH_TASK = "payment_worker.dlq.record_crash"
# the longest a crash record's task pauses before putting its message back (its retry could
# not be published): a task slot held, not a tight loop
_REQUEUE_PAUSE_MAX = 10.0
PROCESS_TASK_NAME = "payment_worker.process_account_batch"


class BatchMissing(PaymentWorkerError):
    """``process_account_batch`` named a batch that does not exist (the class name is what the
    dead letter records; it is never raised)."""


def traceback_digest(tb: TracebackType | str | None) -> str:
    """A short stable digest of a traceback, and its last frames, to group identical crashes."""
    if tb is None:
        return ""
    text = tb if isinstance(tb, str) else "".join(tb_mod.format_tb(tb))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    tail = text.strip().splitlines()[-4:]
    return f"{digest} " + " | ".join(line.strip() for line in tail)


def _batch_id_of(task_name: str, args: list[Any]) -> str | None:
    if task_name == PROCESS_TASK_NAME and args and isinstance(args[0], str):
        return args[0]
    return None


def record_crash(
    *,
    task_name: str,
    args: list[Any],
    error_class: str,
    error: str,
    digest: str,
    task_id: str | None,
) -> None:
    """Write the ``task_crashed`` dead letter now; publish it to the ``dlq`` queue if the
    database cannot be reached. Never raises (it runs inside Celery's signal handling)."""
    fields: dict[str, Any] = {
        "task_name": task_name,
        "args": list(args),
        "error_class": error_class,
        "error": redact(error[:1100])[:1000],  # an exception's text may echo a body or URL
        "traceback_digest": digest,
        "batch_id": _batch_id_of(task_name, list(args)),
        "task_id": task_id,
    }
    try:
        with runtime.current().engine.begin() as conn:
            dl_id = record_task_crash(conn, **fields)
        DEAD_LETTERS.labels("task_crashed").inc()
        log.error("task_crashed", dead_letter_id=dl_id, task=task_name, error_class=error_class)
    except Exception as exc:
        log.error("task_crash_not_written", task=task_name, error=repr(exc))
        try:
            app.send_task(RECORD_CRASH_TASK, kwargs=fields, queue="dlq", routing_key="dlq")
        except Exception as exc2:
            log.error("task_crash_lost", task=task_name, error=repr(exc2), **fields)


@app.task(bind=True, name=RECORD_CRASH_TASK, max_retries=None)
def record_crash_task(
    self: Task,
    task_name: str,
    args: list[Any],
    error_class: str,
    error: str,
    traceback_digest: str,
    batch_id: str | None,
    task_id: str | None,
) -> int:
    """Queue ``dlq``: write a crash record the hook could not write (retried until it can,
    with exponential backoff and full jitter up to ``DEAD_LETTER_RETRY_MAX_SECONDS``)."""
    try:
        with runtime.current().engine.begin() as conn:
            dl_id = record_task_crash(
                conn,
                task_name=task_name,
                args=args,
                error_class=error_class,
                error=error,
                traceback_digest=traceback_digest,
                batch_id=batch_id,
                task_id=task_id,
            )
    except Exception as exc:
        # at least 1 s: Celery's full jitter draws 0 too (half of first retries), and a
        # countdown of 0 is no countdown at all, an immediate retry against a refusing Postgres
        countdown = max(
            1,
            get_exponential_backoff_interval(
                factor=1,
                retries=self.request.retries,
                maximum=DEAD_LETTER_RETRY_MAX_SECONDS,
                full_jitter=True,
            ),
        )
        try:
            raise self.retry(exc=exc, countdown=countdown) from exc
        except Reject as rejected:
            # the retry's publish failed: Celery rejects without requeue, and the record
            # would be gone with this message (autoretry_for did that). Back on the queue
            log.warning("task_crash_retry_not_published", task=task_name, error=repr(exc))
            # requeued, it comes back at once with the same retry count: without a pause it
            # would loop as fast as Postgres refuses while the publish keeps failing
            time.sleep(min(countdown, _REQUEUE_PAUSE_MAX))
            raise Reject(rejected.reason, requeue=True) from exc
    DEAD_LETTERS.labels("task_crashed").inc()
    return dl_id


def record_missing_batch(batch_id: str, task_id: str | None) -> None:
    """``process_account_batch`` named a batch that does not exist."""
    record_crash(
        task_name=PROCESS_TASK_NAME,
        args=[batch_id],
        error_class=BatchMissing.__name__,
        error=f"no batch {batch_id!r}",
        digest="",
        task_id=task_id,
    )


@task_failure.connect
def _on_task_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    traceback: TracebackType | None = None,
    **_: Any,
) -> None:
    name = str(getattr(sender, "name", sender))
    if name == RECORD_CRASH_TASK:
        return  # its own retries: never a crash record of a crash record
    record_crash(
        task_name=name,
        args=[*(args or []), *([kwargs] if kwargs else [])],
        error_class=type(exception).__name__ if exception is not None else "unknown",
        error=str(exception),
        digest=traceback_digest(traceback),
        task_id=task_id,
    )


@task_unknown.connect
def _on_task_unknown(
    name: str | None = None, id: str | None = None, exc: BaseException | None = None, **_: Any
) -> None:
    record_crash(
        task_name=str(name),
        args=[],
        error_class="UnknownTask",
        error=str(exc),
        digest="",
        task_id=id,
    )


def _rejected_task(message: Any) -> tuple[str | None, str | None, list[Any]]:
    """The task name, id and positional arguments a rejected message carries, as far as
    they can be read: from its headers (protocol 2) or its decoded body (protocol 1, or a
    protocol 2 body ``[args, kwargs, embed]``). Never raises: what cannot be read is left out."""
    headers = dict(getattr(message, "headers", None) or {})
    name, task_id = headers.get("task"), headers.get("id")
    args: list[Any] = []
    try:
        body = message.decode()
    except Exception:
        body = None
    if isinstance(body, dict):  # protocol 1: everything is in the body
        name, task_id = name or body.get("task"), task_id or body.get("id")
        body = [body.get("args")]
    if isinstance(body, list | tuple) and body and isinstance(body[0], list | tuple):
        args = list(body[0])
    return (
        str(name) if name else None,
        str(task_id) if task_id else None,
        args,
    )


@task_rejected.connect
def _on_task_rejected(message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    # a message the worker cannot route (no task name) or that Celery finds invalid (its
    # on_invalid_task: arguments of the wrong shape, an ETA that is no time): Celery rejects
    # it without running anything; the dead letter keeps what it named, the batch included
    name, task_id, args = _rejected_task(message)
    record_crash(
        task_name=name or "undecodable message",
        args=args,
        error_class=type(exc).__name__ if exc is not None else "UndecodableMessage",
        error=str(exc) if exc is not None else "message could not be decoded",
        digest="",
        task_id=task_id,
    )


class DecodeErrorHook(bootsteps.Step):  # type: ignore[misc]
    """A consumer step: a message the worker cannot decode (Celery logs it and acks it, no
    signal) becomes a ``task_crashed`` dead letter before Celery's own handling runs."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        original = parent.on_decode_error

        def on_decode_error(message: Any, exc: BaseException) -> Any:
            headers = dict(getattr(message, "headers", None) or {})
            body = getattr(message, "body", b"")
            record_crash(
                task_name=str(headers.get("task", "undecodable message")),
                args=[repr(body[:200])],
                error_class=type(exc).__name__,
                error=f"message could not be decoded: {exc}",
                digest="",
                task_id=str(headers["id"]) if headers.get("id") else None,
            )
            return original(message, exc)

        parent.on_decode_error = on_decode_error


# the worker builds its consumer after importing the tasks module (which imports this one)
app.steps["consumer"].add(DecodeErrorHook)
