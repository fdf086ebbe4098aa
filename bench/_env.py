"""A scratch database and Redis dbs for a benchmark run (shared by the bench scripts)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def with_path(url: str, path: str) -> str:
    """``url`` with its path replaced."""
    return urlunsplit(urlsplit(url)._replace(path=path))


def machine() -> str:
    """One line describing this machine."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (
        f"{os.cpu_count()} cores, {cpu or platform.processor()}, Python {platform.python_version()}"
    )


@contextlib.contextmanager
def scratch(redis_dbs: tuple[int, int] = (13, 14)) -> Iterator[tuple[str, str, str]]:
    """Create ``pw_bench_<pid>`` (migrated) and flush two Redis dbs; set the URLs in os.environ.

    Yields (database_url, redis_url, broker_url); the database is dropped at the end.
    """
    import psycopg
    import redis

    from payment_worker import runtime
    from payment_worker.db import migrate
    from payment_worker.runtime import ServiceUrls
    from payment_worker.settings import load_settings

    base = ServiceUrls.resolve(load_settings())
    base_pg, base_redis = base.database, base.redis
    name = f"pw_bench_{os.getpid()}"
    admin = with_path(base_pg, "/postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    db = with_path(base_pg, f"/{name}")
    r_app = with_path(base_redis, f"/{redis_dbs[0]}")
    r_broker = with_path(base_redis, f"/{redis_dbs[1]}")
    # two benchmarks on one Redis server would flush each other's dbs (locks, the broker's
    # queue) mid-run: the second one stops here instead
    held = _hold_redis_dbs(base_redis, redis_dbs)
    os.environ.update({"DATABASE_URL": db, "REDIS_URL": r_app, "CELERY_BROKER_URL": r_broker})
    runtime.reset()  # rebuilt from the environment above on first use
    try:
        for url in (r_app, r_broker):
            redis.Redis.from_url(url).flushdb()
        migrate.upgrade(db.replace("postgresql://", "postgresql+psycopg://", 1))
        yield db, r_app, r_broker
    finally:
        runtime.reset()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        held.close()


def _hold_redis_dbs(redis_url: str, dbs: tuple[int, int]) -> Any:
    """An exclusive lock (a file under the temp directory, freed when its holder exits) on
    ``dbs`` of the Redis server at ``redis_url``; exits with a message if another process
    holds it."""
    import fcntl
    import hashlib
    import tempfile

    parts = urlsplit(redis_url)
    server = hashlib.sha1(f"{parts.hostname}:{parts.port}".encode()).hexdigest()[:10]
    path = Path(tempfile.gettempdir()) / f"pw-bench-redis-{server}-{dbs[0]}-{dbs[1]}.lock"
    handle = path.open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise SystemExit(
            f"another benchmark is using Redis dbs {dbs[0]} and {dbs[1]} of "
            f"{parts.hostname}:{parts.port} ({path}): wait for it to finish"
        ) from None
    return handle


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def create_request(host: str, token: str, payment: Any) -> tuple[str, dict[str, str], bytes]:
    """The service's create request for ``payment`` (a ``PaymentRequest``): its path,
    headers and compact JSON body, as ``GatewayClient`` sends them."""
    headers = {
        "Host": host,
        "Accept": "application/json",
        "User-Agent": "payment-worker",
        "Authorization": "Bearer " + token,
        "Idempotency-Key": payment.idempotency_key,
        "Content-Type": "application/json",
    }
    body = json.dumps(payment.body(), separators=(",", ":")).encode()
    return f"/v1/accounts/{payment.account_id}/payments", headers, body


def git_rev() -> str:
    """The current commit, short."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
