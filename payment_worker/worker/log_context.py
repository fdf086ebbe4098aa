"""Celery's logging goes through ours: the ``setup_logging`` receiver, and each task's context.

Connected when the Celery app is imported (``celery_app`` imports this module), so that it is
in place before Celery would configure logging itself: with a receiver on ``setup_logging``
Celery installs no handler and does not redirect stdout, and its own records (``celery@host
ready.``, a task's failure) reach the root logger, rendered by the same processors as ours
(``payment_worker.ops.logging``). Its two INFO lines of every message (``Task ... received``,
``succeeded in``) are dropped unless ``LOG_TASK_LINES=true`` (:class:`TaskLinesFilter`).

Each task binds ``task_id`` and ``task`` at ``task_prerun`` (the task body adds ``batch_id``,
the drain loop ``account_id``, and per item ``transaction_id``, ``attempt`` and
``fence_token``); ``task_postrun`` clears them. Context variables belong to the thread (or
process) running the task, and a threads-pool thread runs many tasks one after another, so
the context is also cleared before binding: nothing of an earlier task can leak into the next.

Under JSON logs the worker's startup banner (plain text on stdout) is replaced by one
``worker_starting`` line, so the whole output stays one JSON stream.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.app import trace as celery_trace
from celery.signals import (
    celeryd_after_setup,
    celeryd_init,
    setup_logging,
    task_postrun,
    task_prerun,
)
from structlog.contextvars import bind_contextvars, clear_contextvars

from payment_worker import runtime
from payment_worker.ops.logging import (
    configure_from_settings,
    get_logger,
    json_lines,
)
from payment_worker.ops.redaction import mask_url
from payment_worker.settings import Settings

log = get_logger("worker")


class TaskLinesFilter(logging.Filter):
    """Drops Celery's two INFO lines of every message, ``Task ... received`` and ``Task ...
    succeeded in ...``; every other record passes (failures, retries, the worker's own).

    Why: at thousands of messages a second they cost about 0.2 ms of worker CPU a message
    (issue 13, docs/benchmarks.md), and our ``account_drained`` line names the same task,
    batch and account with the outcome. ``LOG_TASK_LINES=true`` keeps them."""

    DROPPED = frozenset({celery_trace.LOG_RECEIVED, celery_trace.LOG_SUCCESS})

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the two lines above."""
        return record.msg not in self.DROPPED


#: the loggers Celery writes those lines to (the consumer's strategy, the task tracer)
TASK_LINE_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


def apply_task_lines_setting(keep: bool) -> None:
    """Install :class:`TaskLinesFilter` on Celery's loggers unless ``keep`` (LOG_TASK_LINES);
    idempotent."""
    for name in TASK_LINE_LOGGERS:
        logger = logging.getLogger(name)
        present = [f for f in logger.filters if isinstance(f, TaskLinesFilter)]
        if keep:
            for f in present:
                logger.removeFilter(f)
        elif not present:
            logger.addFilter(TaskLinesFilter())


def _configure(settings: Settings) -> None:
    configure_from_settings(settings)
    apply_task_lines_setting(settings.log_task_lines)


def _setup_logging(loglevel: Any = None, **_: Any) -> None:
    # our configuration for every logger; Celery's --loglevel is not used (LOG_LEVEL is)
    _configure(runtime.current().settings)


def _task_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    clear_contextvars()
    bind_contextvars(task_id=task_id, task=getattr(task, "name", None))


def _task_postrun(**_: Any) -> None:
    clear_contextvars()


def _worker_configuring(instance: Any = None, **_: Any) -> None:
    # celeryd_init: the worker's first signal, before Celery's own warnings (running as
    # root...) and its setup_logging: configure now, so that every line is ours
    _configure(runtime.current().settings)
    if json_lines() and instance is not None:
        instance.quiet = True  # no plain-text banner on stdout; worker_starting says it


def _worker_starting(sender: Any = None, instance: Any = None, conf: Any = None, **_: Any) -> None:
    if not json_lines() or instance is None:
        return
    app = instance.app
    log.info(
        "worker_starting",
        hostname=sender,
        pool=_name(getattr(instance, "pool_cls", None)),
        concurrency=getattr(instance, "concurrency", None),
        queues=sorted(app.amqp.queues.consume_from or app.amqp.queues),
        broker=mask_url(app.connection().as_uri(include_password=False)),
    )


def _name(cls: Any) -> str | None:
    if cls is None or isinstance(cls, str):
        return cls
    return f"{cls.__module__}.{cls.__qualname__}"


# connected at import (plain calls: Celery's decorators are untyped)
setup_logging.connect(_setup_logging, weak=False)
task_prerun.connect(_task_prerun, weak=False)
task_postrun.connect(_task_postrun, weak=False)
celeryd_init.connect(_worker_configuring, weak=False)
celeryd_after_setup.connect(_worker_starting, weak=False)
