"""Pins the Celery reliability settings, so nobody loosens them by accident."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from payment_worker.settings import THREADS_CONCURRENCY, Settings
from payment_worker.worker.broker_transport import TRANSPORT
from payment_worker.worker.celery_config import build_config

BROKER = "redis://127.0.0.1:1/0"  # never connected to: building the config starts no server


def test_reliability_settings() -> None:
    s = Settings(redis_url=BROKER)
    c = build_config(s, BROKER)
    assert c["task_acks_late"] is True
    assert c["task_reject_on_worker_lost"] is True
    assert c["worker_prefetch_multiplier"] == 1
    # running on through a lost connection: a cancelled prefork child dies mid-drain
    assert c["worker_cancel_long_running_tasks_on_connection_loss"] is False
    vt = c["broker_transport_options"]["visibility_timeout"]
    assert vt == c["result_backend_transport_options"]["visibility_timeout"]
    assert c["task_time_limit"] < vt
    assert c["task_soft_time_limit"] < c["task_time_limit"]
    assert s.retry_max_delay < vt
    assert {q.name for q in c["task_queues"]} == {"payments", "dlq"}
    assert c["broker_url"] == BROKER


def test_kombus_redis_pool_follows_the_task_slots() -> None:
    # redis-py 8 raises past a pool's cap: every task thread may ack or publish at once
    c = build_config(Settings(redis_url=BROKER), BROKER)
    assert c["broker_transport_options"]["max_connections"] >= 2 * c["worker_concurrency"]
    small = build_config(Settings(redis_url=BROKER, worker_pool="solo"), BROKER)
    assert small["broker_transport_options"]["max_connections"] == 100


def test_task_events_are_off_unless_asked_for() -> None:
    # issue 13: with events a worker spent a third more CPU per item; Flower and celery-exporter
    # (the compose stack) turn them on with WORKER_TASK_EVENTS
    off = build_config(Settings(redis_url=BROKER), BROKER)
    assert off["worker_send_task_events"] is False and off["task_send_sent_event"] is False
    on = build_config(Settings(redis_url=BROKER, worker_task_events=True), BROKER)
    assert on["worker_send_task_events"] is True and on["task_send_sent_event"] is True


def test_plain_command_runs_threads_at_high_concurrency() -> None:
    # issue 13: `celery -A payment_worker worker` with no flag is the fast recipe
    c = build_config(Settings(redis_url=BROKER), BROKER)
    assert c["worker_pool"] == "threads"
    assert c["worker_concurrency"] == THREADS_CONCURRENCY >= 500


@pytest.mark.parametrize(
    ("pool", "concurrency", "expected"),
    [
        ("prefork", None, os.cpu_count() or 1),  # a process per slot: never 500 of them
        ("solo", None, 1),
        ("threads", "64", 64),
        ("PREFORK", "3", 3),
    ],
)
def test_pool_and_concurrency_from_settings(
    monkeypatch: pytest.MonkeyPatch, pool: str, concurrency: str | None, expected: int
) -> None:
    monkeypatch.setenv("WORKER_POOL", pool)
    if concurrency is None:
        monkeypatch.delenv("WORKER_CONCURRENCY", raising=False)
    else:
        monkeypatch.setenv("WORKER_CONCURRENCY", concurrency)
    c = build_config(Settings(redis_url=BROKER), BROKER)
    assert c["worker_pool"] == pool.lower()
    assert c["worker_concurrency"] == expected


def _start_worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    dummy = {
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        "REDIS_URL": "redis://127.0.0.1:1/0",
    }
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "payment_worker", "worker"],
        env={**base, **dummy, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("var", "value", "why"),
    [
        ("WORKER_POOL", "gevent", "-P gevent"),
        ("WORKER_POOL", "eventlet", "-P eventlet"),
        ("WORKER_POOL", "fork", "threads"),
        ("WORKER_CONCURRENCY", "0", "greater than or equal to 1"),
        ("WORKER_CONCURRENCY", "many", "integer"),
    ],
)
def test_bad_pool_or_concurrency_one_line_exit_2(var: str, value: str, why: str) -> None:
    proc = _start_worker({var: value})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert var in lines[0] and why in lines[0]
    assert "Traceback" not in proc.stderr


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


@pytest.mark.parametrize(
    ("argv", "pool", "slots"),
    [
        (["celery", "-A", "payment_worker", "worker"], "threads", THREADS_CONCURRENCY),
        (["celery", "-A", "payment_worker", "worker", "-P", "prefork"], "prefork", None),
        (["celery", "-A", "payment_worker", "worker", "--pool=solo"], "solo", 1),
        (
            ["celery", "-A", "payment_worker", "worker", "-Pthreads", "-c", "7"],
            "threads",
            THREADS_CONCURRENCY,
        ),
        # not a worker command line: the settings decide
        (["celery", "-A", "payment_worker", "beat"], "threads", THREADS_CONCURRENCY),
        (["pytest", "-P", "prefork"], "threads", THREADS_CONCURRENCY),
    ],
)
def test_an_explicit_pool_on_the_worker_command_line_wins(
    argv: list[str], pool: str, slots: int | None
) -> None:
    # Celery reads `-P prefork` as "no option" once a pool is configured: we read it ourselves
    c = build_config(Settings(redis_url=BROKER), BROKER, argv)
    assert c["worker_pool"] == pool
    # the default slots follow the pool that runs (-c itself is applied by Celery)
    assert c["worker_concurrency"] == (slots if slots is not None else os.cpu_count() or 1)


@pytest.mark.parametrize(
    "flag", [["-c", "3000"], ["-c3000"], ["--concurrency", "3000"], ["--concurrency=3000"]]
)
def test_kombus_pool_follows_an_explicit_concurrency_on_the_command_line(flag: list[str]) -> None:
    """``-c`` wins over WORKER_CONCURRENCY, so kombu's pool cap follows it: with the setting's
    1,000 slots, ``-c 3000`` had a cap of 2,000 connections, past which redis-py 8 raises
    (a review found it)."""
    argv = ["celery", "-A", "payment_worker", "worker", *flag]
    c = build_config(Settings(redis_url=BROKER), BROKER, argv)
    assert c["broker_transport_options"]["max_connections"] == 6000
    # a -c of another subcommand, or none, leaves the settings' slots
    beat = build_config(Settings(redis_url=BROKER), BROKER, ["celery", "beat", *flag])
    assert beat["broker_transport_options"]["max_connections"] == 2 * THREADS_CONCURRENCY


def test_a_plain_redis_broker_gets_the_reused_client_transport() -> None:
    # kombu's own transport builds a redis.Redis per ack and publish (broker_transport.py);
    # rediss:// keeps kombu's choice, whose TLS defaults follow the scheme's name
    assert build_config(Settings(redis_url=BROKER), BROKER)["broker_transport"] == TRANSPORT
    for url in ("rediss://127.0.0.1:1/0", "amqp://guest@127.0.0.1//", "sentinel://127.0.0.1:1"):
        assert build_config(Settings(redis_url=BROKER), url)["broker_transport"] is None


def test_the_broker_takes_messages_in_blocks_of_broker_take_batch() -> None:
    assert build_config(Settings(), "redis://x/0")["broker_transport_options"]["take_batch"] == 32
    one = build_config(Settings(broker_take_batch=1), "redis://x/0")
    assert one["broker_transport_options"]["take_batch"] == 1  # kombu's own behaviour
