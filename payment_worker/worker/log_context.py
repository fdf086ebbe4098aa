"""Celery's logging goes through ours: the ``setup_logging`` receiver, and each task's context.

Connected when the Celery app is imported (``celery_app`` imports this module), so that it is
in place before Celery would configure logging itself: with a receiver on ``setup_logging``
Celery installs no handler and does not redirect stdout, and its own records (``celery@host
ready.``, ``Task ... received``, ``succeeded in``) reach the root logger, rendered by the same
processors as ours (``payment_worker.ops.logging``).

Each task binds ``task_id`` and ``task`` at ``task_prerun`` (the task body adds ``batch_id``,
the drain loop ``account_id``, and per item ``transaction_id``, ``attempt`` and
``fence_token``); ``task_postrun`` clears them. Context variables belong to the thread (or
process) running the task, and a threads-pool thread runs many tasks one after another, so
the context is also cleared before binding: nothing of an earlier task can leak into the next.

Under JSON logs the worker's startup banner (plain text on stdout) is replaced by one
``worker_starting`` line, so the whole output stays one JSON stream.
"""

from __future__ import annotations

from typing import Any

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

log = get_logger("worker")


def _setup_logging(loglevel: Any = None, **_: Any) -> None:
    # our configuration for every logger; Celery's --loglevel is not used (LOG_LEVEL is)
    configure_from_settings(runtime.current().settings)


def _task_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    clear_contextvars()
    bind_contextvars(task_id=task_id, task=getattr(task, "name", None))


def _task_postrun(**_: Any) -> None:
    clear_contextvars()


def _worker_configuring(instance: Any = None, **_: Any) -> None:
    # celeryd_init: the worker's first signal, before Celery's own warnings (running as
    # root...) and its setup_logging: configure now, so that every line is ours
    s = runtime.current().settings
    configure_from_settings(s)
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
