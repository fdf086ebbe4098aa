"""Processes and files of the embedded servers: liveness that trusts no stale file, atomic
writes, and the inter-process file lock that makes one process start each server."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from payment_worker.embedded.errors import EmbeddedError
from payment_worker.ops.logging import get_logger

LOCK_TIMEOUT = 180.0
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0

log = get_logger("embedded")


# Linux: a process's state and working folder are read off /proc; elsewhere (macOS) a
# live pid is judged by kill(0) alone
_HAS_PROC = Path("/proc/self/stat").exists()


def proc_state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z``...), ``?`` if unknown, None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if _HAS_PROC:
            return None
        stat = ""  # no /proc at all: every pid looked dead
    except OSError:
        stat = ""
    if stat:
        # the command name is in parentheses and may itself contain spaces or parentheses
        return stat.rsplit(")", 1)[1].split()[0]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "?"


def pid_alive(pid: int) -> bool:
    # a zombie holds no socket and no file: it is dead (PID 1 may never reap it)
    return pid > 0 and proc_state(pid) not in (None, "Z", "X")


def pid_cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def pid_works_in(pid: int, directory: Path) -> bool:
    """True if ``pid`` is alive and its working directory is ``directory``.

    PostgreSQL and Redis both chdir into their data folder, which tells our servers apart
    from a process that reused a stale pid. Without /proc (macOS) a live pid is trusted.
    """
    if not pid_alive(pid):
        return False
    if not Path("/proc/self/cwd").exists():
        return True
    return pid_cwd(pid) == os.path.realpath(directory)


def pid_exe(pid: int) -> str | None:
    """The process's executable (``/proc/<pid>/exe``), or None when it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def processes_in(directory: Path) -> list[int]:
    """Live processes (other than this one) whose working directory is ``directory``."""
    real = os.path.realpath(directory)
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc/self").exists() else []:
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if pid_cwd(pid) == real and pid_alive(pid):
                found.append(pid)
    return found


def wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def read_int(path: Path, line: int = 0) -> int | None:
    try:
        return int(path.read_text().splitlines()[line].strip())
    except (OSError, ValueError, IndexError):
        return None


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def file_lock(home: Path, name: str, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """An exclusive inter-process lock on ``home/.lock-<name>``; released by the OS on death."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / f".lock-{name}", "a+") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmbeddedError(
                        f"another process has held {home / ('.lock-' + name)} for {timeout:.0f}s"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def terminate(pid: int, first: signal.Signals, what: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    if not wait_dead(pid, STOP_TIMEOUT):
        log.warning("embedded_server_killed", server=what, pid=pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_dead(pid, 5)
