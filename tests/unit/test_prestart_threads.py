"""prestart_threads (worker/lifecycle.py) on a real ThreadPoolExecutor, as Celery's threads
pool holds one: every thread started at once, no work queued, tasks run as before."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from payment_worker.worker.lifecycle import prestart_threads


def test_every_thread_is_started_and_tasks_still_run_at_once() -> None:
    executor = ThreadPoolExecutor(max_workers=8)
    try:
        assert prestart_threads(SimpleNamespace(executor=executor)) == 8
        assert len(executor._threads) == 8
        assert all(t.is_alive() for t in executor._threads)
        # no work was queued: eight tasks that wait for each other all run together
        barrier = threading.Barrier(8)
        futures = [executor.submit(barrier.wait, 5) for _ in range(8)]
        assert sorted(f.result(timeout=10) for f in futures) == list(range(8))
        assert len(executor._threads) == 8  # none added by the submits
    finally:
        executor.shutdown()


def test_a_second_call_adds_nothing() -> None:
    executor = ThreadPoolExecutor(max_workers=3)
    try:
        assert prestart_threads(SimpleNamespace(executor=executor)) == 3
        assert prestart_threads(SimpleNamespace(executor=executor)) == 3
        assert len(executor._threads) == 3
    finally:
        executor.shutdown()


def test_pools_without_threads_are_left_alone() -> None:
    assert prestart_threads(None) is None
    assert prestart_threads(SimpleNamespace()) is None  # prefork, solo: no executor
