"""LOG_TASK_LINES: Celery's two INFO lines of each message are dropped by default, nothing
else of Celery's is (worker/log_context.py, docs/logging.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery.app import trace as celery_trace

from payment_worker.settings import Settings
from payment_worker.worker.log_context import (
    TASK_LINE_LOGGERS,
    TaskLinesFilter,
    apply_task_lines_setting,
)


@pytest.fixture
def clean_loggers() -> Iterator[None]:
    saved = {n: list(logging.getLogger(n).filters) for n in TASK_LINE_LOGGERS}
    for n in TASK_LINE_LOGGERS:
        logging.getLogger(n).filters = []
    yield
    for n, filters in saved.items():
        logging.getLogger(n).filters = filters


def _passes(logger_name: str, msg: str, level: int = logging.INFO) -> bool:
    """Whether a record of Celery's own making gets past the logger's filters."""
    record = logging.getLogger(logger_name).makeRecord(
        logger_name, level, __file__, 1, msg, {"id": "t1", "name": "x"}, None
    )
    return bool(logging.getLogger(logger_name).filter(record))


def test_default_setting_is_off() -> None:
    assert Settings.model_fields["log_task_lines"].default is False
    assert Settings(log_task_lines="true").log_task_lines is True  # type: ignore[arg-type]


def test_received_and_succeeded_dropped_everything_else_kept(clean_loggers: None) -> None:
    apply_task_lines_setting(keep=False)
    assert not _passes("celery.worker.strategy", celery_trace.LOG_RECEIVED)
    assert not _passes("celery.app.trace", celery_trace.LOG_SUCCESS)
    # a retry, a failure, an unexpected error of Celery's: still logged
    for msg, level in (
        (celery_trace.LOG_RETRY, logging.INFO),
        (celery_trace.LOG_FAILURE, logging.ERROR),
        (celery_trace.LOG_INTERNAL_ERROR, logging.CRITICAL),
    ):
        assert _passes("celery.app.trace", msg, level), msg
    assert _passes("celery.worker.strategy", "Received unregistered task of type %r")


def test_idempotent_and_reversible(clean_loggers: None) -> None:
    apply_task_lines_setting(keep=False)
    apply_task_lines_setting(keep=False)  # the worker configures at two signals
    for n in TASK_LINE_LOGGERS:
        assert sum(isinstance(f, TaskLinesFilter) for f in logging.getLogger(n).filters) == 1
    apply_task_lines_setting(keep=True)
    assert _passes("celery.worker.strategy", celery_trace.LOG_RECEIVED)
    assert _passes("celery.app.trace", celery_trace.LOG_SUCCESS)
