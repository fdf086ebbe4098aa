"""What a worker process runs beside its task slots: the sweeper thread.

Celery imports this module in every worker (it is in the app's ``include`` list), which
connects the receivers below; they start a :class:`~payment_worker.worker.sweeper.SweeperThread`
in each process that runs tasks and stop it at shutdown:

* prefork (WORKER_POOL=prefork): in each forked child (``worker_process_init``), never in the
  parent, which forks new children all along (``worker_max_tasks_per_child``) and must not
  fork with a thread of its own inside a database or Redis call;
* threads (the default pool) and solo: in the worker process itself, once its pool has started
  (``worker_ready``; solo already sends ``worker_process_init`` in-process).

Why a thread and not a message: see :mod:`payment_worker.worker.sweeper` and the Sweeper
section of docs/processing.md. The thread is found again through ``threading.enumerate()``:
this module keeps no state of its own.
"""

from __future__ import annotations

import threading
from typing import Any

from celery.signals import (
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from payment_worker import runtime
from payment_worker.ops.logging import get_logger
from payment_worker.worker.sweeper import SweeperThread

log = get_logger("worker")


def _running() -> list[SweeperThread]:
    return [t for t in threading.enumerate() if isinstance(t, SweeperThread) and t.is_alive()]


def start_sweeper() -> SweeperThread:
    """This process's sweeper thread, started if it is not running yet."""
    running = _running()
    if running:
        return running[0]
    rt = runtime.current()
    thread = SweeperThread(runtime.current, rt.settings.sweeper_interval)
    thread.start()
    log.info("sweeper_thread_started", interval=rt.settings.sweeper_interval)
    return thread


def stop_sweeper(timeout: float = 5.0) -> None:
    """Stop this process's sweeper thread (a pass in progress gets ``timeout`` seconds)."""
    for thread in _running():
        thread.stop(timeout)


def _runs_tasks_here(pool: Any) -> bool:
    """Whether the worker's own process runs tasks (every pool but prefork)."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    return not isinstance(pool, PreforkPool)


def _child_started(**_: Any) -> None:
    start_sweeper()


def _worker_ready(sender: Any = None, **_: Any) -> None:
    if _runs_tasks_here(getattr(sender, "pool", None)):
        start_sweeper()


def _stopping(**_: Any) -> None:
    stop_sweeper()


# connected when Celery imports this module (plain calls: Celery's decorators are untyped)
worker_process_init.connect(_child_started)
worker_ready.connect(_worker_ready)
worker_process_shutdown.connect(_stopping)
worker_shutdown.connect(_stopping)
