"""warm_result_backend (worker/lifecycle.py) on the service's Celery app: Celery's scan of
the installed packages for result backends runs once, before any task thread asks, and every
thread shares the one backend it built."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery.utils import imports as celery_imports

from payment_worker.worker.celery_app import app
from payment_worker.worker.lifecycle import warm_result_backend


def test_the_scan_runs_once_and_every_thread_shares_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scans: list[str] = []
    scan = celery_imports.entry_points

    def counted(*a: Any, **k: Any) -> Any:
        scans.append(str(k.get("group")))
        return scan(*a, **k)

    monkeypatch.setattr(celery_imports, "entry_points", counted)
    # a fresh process: nothing cached, no backend built yet
    celery_imports.load_extension_class_names.cache_clear()
    monkeypatch.setattr(app, "_backend_cache", None)
    monkeypatch.setattr(app, "_local", threading.local())

    warm_result_backend(app)
    assert scans == ["celery.result_backends"]
    warmed = app.backend
    assert warmed.thread_safe  # the config's flag: one instance for the process

    # a burst of task threads, all asking at once, as at the first task ends of a worker
    seen: list[Any] = []
    barrier = threading.Barrier(16)

    def task_end() -> None:
        barrier.wait(5)
        seen.append(app.backend)

    threads = [threading.Thread(target=task_end) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 16 and all(b is warmed for b in seen)
    assert scans == ["celery.result_backends"]  # no thread scanned again
