"""A real PgBouncer (Debian's ``pgbouncer`` binary) in front of a test database, for tests.

:func:`run_pgbouncer` writes a config into a fresh folder (transaction pooling, a free port on
127.0.0.1, no unix socket, ``auth_type = any`` with the server login in the database line),
starts ``pgbouncer`` in the foreground and stops it at the end. Run as root, PgBouncer refuses
to start, so it runs as the owner of the server's socket folder (the embedded server's OS
user) or ``nobody``. ``.ci/run`` installs the package when it is missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from payment_worker.dev.local_cluster import free_port

PGBOUNCER = "/usr/sbin/pgbouncer"


def pgbouncer_binary() -> str | None:
    """The pgbouncer executable, or None when it is not installed."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return PGBOUNCER if os.access(PGBOUNCER, os.X_OK) else None


@dataclass(frozen=True)
class Bouncer:
    """A running PgBouncer: the client URL of the database, and of its admin console."""

    url: str
    admin_url: str
    pool_size: int
    log_path: Path

    def show(self, what: str) -> list[dict[str, object]]:
        """``SHOW <what>`` on the admin console (STATS, POOLS, SERVERS...), as dicts."""
        # the admin console speaks the simple query protocol only
        with psycopg.connect(self.admin_url, autocommit=True, prepare_threshold=None) as conn:
            cur = conn.cursor()
            cur.execute(f"SHOW {what}".encode(), prepare=False)
            names = [d.name for d in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


@contextlib.contextmanager
def run_pgbouncer(database_url: str, *, pool_size: int = 10) -> Iterator[Bouncer]:
    """PgBouncer in transaction pooling mode in front of ``database_url`` (libpq URL)."""
    binary = pgbouncer_binary()
    if binary is None:
        raise FileNotFoundError("pgbouncer is not installed (apt-get install pgbouncer)")
    info = conninfo_to_dict(database_url)
    host = str(info.get("host") or "/var/run/postgresql")
    dbname = str(info["dbname"])
    user = str(info.get("user") or "postgres")
    server = [f"host={host}", f"port={info.get('port') or 5432}", f"dbname={dbname}"]
    server.append(f"user={user}")
    if info.get("password"):
        server.append(f"password={info['password']}")
    run_as: str | None = None
    if os.geteuid() == 0:
        # pgbouncer will not run as root; the socket folder's owner can reach the server
        run_as = pwd.getpwuid(os.stat(host).st_uid).pw_name if host.startswith("/") else "nobody"
        if run_as == "root":
            run_as = "nobody"
    # not under pytest's tmp_path: its parents are closed to any other user
    folder = Path(tempfile.mkdtemp(prefix="pw-pgbouncer-"))
    port = free_port()
    log_path = folder / "pgbouncer.log"
    (folder / "pgbouncer.ini").write_text(
        "\n".join(
            [
                "[databases]",
                f"{dbname} = {' '.join(server)}",
                "",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = any",
                "pool_mode = transaction",
                "max_client_conn = 1000",
                f"default_pool_size = {pool_size}",
                "max_db_connections = 0",
                f"admin_users = {user}",
                f"stats_users = {user}",
                f"logfile = {log_path}",
                "",
            ]
        )
    )
    argv = [binary]
    if run_as is not None:
        pw = pwd.getpwnam(run_as)
        os.chown(folder, pw.pw_uid, pw.pw_gid)
        for f in folder.iterdir():
            os.chown(f, pw.pw_uid, pw.pw_gid)
        argv += ["-u", run_as]
    argv.append(str(folder / "pgbouncer.ini"))
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
    )
    url = f"postgresql://{user}@127.0.0.1:{port}/{dbname}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                log = log_path.read_text() if log_path.exists() else ""
                raise RuntimeError(f"pgbouncer exited ({proc.returncode}): {log[-2000:]}")
            try:
                with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        admin = f"postgresql://{user}@127.0.0.1:{port}/pgbouncer"
        yield Bouncer(url=url, admin_url=admin, pool_size=pool_size, log_path=log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(folder, ignore_errors=True)
