"""Pins the Celery reliability settings, so nobody loosens them by accident."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from payment_worker.settings import get_settings


@pytest.fixture
def conf(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    # a URL that is never connected to: reading the config must start no server
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    get_settings.cache_clear()
    import importlib

    import payment_worker.worker.celery_config as cc

    importlib.reload(cc)
    from payment_worker.worker.celery_app import app

    app.conf.clear()  # pragma: no cover - re-read the reloaded module
    app.config_from_object(cc, force=True)
    yield app.conf
    get_settings.cache_clear()


def test_reliability_settings(conf: object) -> None:
    c = conf
    s = get_settings()
    assert c.task_acks_late is True  # type: ignore[attr-defined]
    assert c.task_reject_on_worker_lost is True  # type: ignore[attr-defined]
    assert c.worker_prefetch_multiplier == 1  # type: ignore[attr-defined]
    assert c.worker_cancel_long_running_tasks_on_connection_loss is True  # type: ignore[attr-defined]
    vt = c.broker_transport_options["visibility_timeout"]  # type: ignore[attr-defined]
    assert vt == c.result_backend_transport_options["visibility_timeout"]  # type: ignore[attr-defined]
    assert c.task_time_limit < vt  # type: ignore[attr-defined]
    assert c.task_soft_time_limit < c.task_time_limit  # type: ignore[attr-defined]
    assert s.retry_max_delay < vt
    queues = {q.name for q in c.task_queues}  # type: ignore[attr-defined]
    assert {"payments", "dlq"} <= queues
    assert c.broker_url == "redis://127.0.0.1:1/0"  # type: ignore[attr-defined]


def test_app_found_by_celery_dash_a() -> None:
    import payment_worker

    assert payment_worker.app.main == "payment_worker"
