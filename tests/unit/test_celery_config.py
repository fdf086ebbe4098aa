"""Pins the Celery reliability settings, so nobody loosens them by accident."""

from __future__ import annotations

import subprocess
import sys

from payment_worker.settings import Settings
from payment_worker.worker.celery_config import build_config

BROKER = "redis://127.0.0.1:1/0"  # never connected to: building the config starts no server


def test_reliability_settings() -> None:
    s = Settings(redis_url=BROKER)
    c = build_config(s, BROKER)
    assert c["task_acks_late"] is True
    assert c["task_reject_on_worker_lost"] is True
    assert c["worker_prefetch_multiplier"] == 1
    assert c["worker_cancel_long_running_tasks_on_connection_loss"] is True
    vt = c["broker_transport_options"]["visibility_timeout"]
    assert vt == c["result_backend_transport_options"]["visibility_timeout"]
    assert c["task_time_limit"] < vt
    assert c["task_soft_time_limit"] < c["task_time_limit"]
    assert s.retry_max_delay < vt
    assert {q.name for q in c["task_queues"]} == {"payments", "dlq"}
    assert c["broker_url"] == BROKER


def test_app_found_by_celery_dash_a() -> None:
    import payment_worker

    assert payment_worker.app.main == "payment_worker"


def test_importing_every_module_starts_nothing() -> None:
    # no URL set and a home that must not appear: an import that started an embedded server
    # (or read the settings and failed) would create it or exit
    code = (
        "import pkgutil, importlib, payment_worker\n"
        "for m in pkgutil.walk_packages(payment_worker.__path__, 'payment_worker.'):\n"
        "    if '.migrations' not in m.name:\n"
        "        importlib.import_module(m.name)\n"
        "print(payment_worker.app.main)\n"
    )
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        home = os.path.join(tmp, "home")
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")
        }
        env["PAYMENT_WORKER_HOME"] = home
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "payment_worker"
        assert not os.path.exists(home), "an import started an embedded server"
