"""The embedded PostgreSQL (pgserver's binaries): initdb once, start on a unix socket whose path
depends on the home folder only, recover after a crash, and as root run as an OS user that is
created when missing."""

from __future__ import annotations

import contextlib
import grp
import hashlib
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from urllib.parse import quote

from payment_worker.embedded.errors import EmbeddedError, EmbeddedNotInstalled
from payment_worker.embedded.processes import (
    START_TIMEOUT,
    STOP_TIMEOUT,
    file_lock,
    log,
    pid_exe,
    pid_works_in,
    processes_in,
    wait_dead,
    write_atomic,
)

DATABASE_NAME = "payment_worker"
# PostgreSQL refuses to run as root; as root it runs as this OS user (EMBEDDED_PG_OS_USER),
# created on first use when missing (pgserver's convention for the name)
DEFAULT_PG_OS_USER = "pgserver"
_PG_SOCKET_NAME = ".s.PGSQL.5432"
# sun_path is 108 bytes on Linux and 104 on macOS, including the terminating NUL
_SOCKET_PATH_MAX = 103


def pgdata_dir(home: Path) -> Path:
    return home / "pgdata"


def pg_url_file(home: Path) -> Path:
    return home / "postgres.url"


def pg_socket_dir(home: Path) -> Path:
    """Where PostgreSQL's unix socket is: in pgdata, or a short folder when that path is too long.

    Derived from ``home`` alone, so the URL is the same across restarts and processes.
    """
    pgdata = pgdata_dir(home.resolve())
    if len(str(pgdata / _PG_SOCKET_NAME)) <= _SOCKET_PATH_MAX:
        return pgdata
    digest = hashlib.sha256(str(pgdata).encode()).hexdigest()[:16]
    name = f"pw-{os.geteuid()}-{digest}"
    base = Path(tempfile.gettempdir())
    if len(str(base / name / _PG_SOCKET_NAME)) > _SOCKET_PATH_MAX:
        base = Path("/tmp")
    return base / name


def pg_url(home: Path, database: str = DATABASE_NAME) -> str:
    host = quote(str(pg_socket_dir(home)), safe="/")
    # the port named: libpq would take a PGPORT from the environment (the socket's name)
    return f"postgresql://postgres@/{database}?host={host}&port=5432"


def postmaster(home: Path) -> tuple[int, str] | None:
    """(pid, status) of our live postmaster under ``home``, else None."""
    pgdata = pgdata_dir(home)
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    if not pid_works_in(pid, pgdata):
        return None
    return pid, (lines[7].strip() if len(lines) > 7 else "")


def pg_ready(home: Path) -> bool:
    pm = postmaster(home)
    return (
        pm is not None
        and pm[1] == "ready"
        and (pg_socket_dir(home) / _PG_SOCKET_NAME).exists()
        and pg_url_file(home).exists()
    )


def postgres_url(home: Path, os_user: str = DEFAULT_PG_OS_USER) -> str:
    """URL of the embedded PostgreSQL database under ``home``, started if it is not running.

    As root the server runs as ``os_user`` (created when missing); otherwise as this user.
    """
    home = home.resolve()
    if not pg_ready(home):
        with file_lock(home, "postgres"):
            if not pg_ready(home):
                _restart_postgres(home, os_user)
    return pg_url(home)


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
    # a group of that name already there (a user removed without its group): join it, since
    # --user-group would refuse to make it again (exit 9, read below as "made meanwhile")
    group = ["--gid", name] if _group_exists(name) else ["--user-group"]
    cmd = [useradd, "--system", *group, "--no-create-home", "--shell", "/bin/false", name]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    # 9: the name was taken meanwhile (another process created it): fine
    if proc.returncode not in (0, 9):
        why = " ".join(proc.stderr.split()) or f"exit code {proc.returncode}"
        raise EmbeddedError(
            f"cannot create the OS user {name!r} the embedded PostgreSQL runs as when started "
            f"by root ({why}); create it, set EMBEDDED_PG_OS_USER to an existing user, or set "
            "DATABASE_URL"
        )
    log.info("embedded_postgres_os_user_created", user=name)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedError(f"useradd reported success but user {name!r} does not exist") from None


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


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
    pgdata = pgdata_dir(home)
    scratch = home / ".pgdata-init"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(mode=0o700)
    if user is not None:
        _prepare_root(scratch, user)
    _chown(scratch, user)
    # the C locale, not the caller's: a LANG the host lacks (a minimal image) or LC_CTYPE=UTF-8
    # (forwarded over SSH from a Mac) made initdb refuse to run; C sorts as C.UTF-8 does
    args = [
        "-D",
        str(scratch),
        "--auth=trust",
        "--auth-local=trust",
        "--encoding=utf8",
        "--locale=C",
    ]
    _pg_command("initdb", [*args, "-U", "postgres"], user, timeout=120)
    os.replace(scratch, pgdata)


def _clear_crashed_server(home: Path) -> None:
    """After a postmaster died: kill its orphaned children, drop its stale lock files."""
    pgdata = pgdata_dir(home)
    # PostgreSQL's own processes only (its binary): a shell or a pager someone left in
    # pgdata (reading its log) is not an orphan to kill
    # (a binary replaced since it started reads "<path> (deleted)")
    binary = os.path.realpath(_pg_bin() / "postgres")
    ours = (binary, f"{binary} (deleted)")
    orphans = [pid for pid in processes_in(pgdata) if pid_exe(pid) in ours]
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in orphans:
        if not wait_dead(pid, STOP_TIMEOUT):
            raise EmbeddedError(f"leftover PostgreSQL process {pid} in {pgdata} will not die")
    if orphans:
        log.warning("embedded_postgres_leftovers_killed", pids=orphans, pgdata=str(pgdata))
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
    if sock_dir != pgdata_dir(home):
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
    pgdata = pgdata_dir(home)
    user = _run_as(os_user)
    pm = postmaster(home)
    if pm is not None:
        # alive and ours, but not (yet) ready: starting up or recovering; never kill it
        deadline = time.monotonic() + START_TIMEOUT
        while (pm := postmaster(home)) is not None and pm[1] != "ready":
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
                # the socket's name carries the port: a PGPORT in the caller's environment
                # would rename it, and the URL names 5432
                "-p 5432",
                f"-k {shlex.quote(str(sock_dir))}",
                "-c unix_socket_permissions=0700",
                # workers, beat, the exporter and test databases all connect at once
                "-c max_connections=200",
            ]
        )
        args = ["-D", str(pgdata), "-l", str(pgdata / "log"), "-w", "-t", str(int(START_TIMEOUT))]
        _pg_command("pg_ctl", [*args, "-o", options, "start"], user, timeout=START_TIMEOUT + 30)
        log.info("embedded_postgres_started", pgdata=str(pgdata), socket_dir=str(sock_dir))
    _ensure_database(home)


def _ensure_database(home: Path) -> None:
    from payment_worker.db.bootstrap import ensure_database

    ensure_database(pg_url(home, "postgres"), DATABASE_NAME)
    write_atomic(pg_url_file(home), pg_url(home) + "\n")
