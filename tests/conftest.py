"""Test fixtures shared by every tier.

Integration tests talk to a real PostgreSQL and a real Redis: the ones named by
DATABASE_URL / REDIS_URL when set, the embedded servers otherwise. Each test gets a fresh
database cloned from a migrated template (CREATE DATABASE ... TEMPLATE ...) and its own
flushed Redis database numbers. A server named by a URL that is down skips the test locally
(the environment) and fails it when CI=true; an embedded server that cannot be started or
reached while its extra is installed always fails it (that is the code's job, see
:func:`service_verdict`).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import psycopg
import pytest
import redis

from payment_worker import runtime
from payment_worker.settings import Settings

pytest_plugins = ["tests.sim_fixtures"]

ROOT = Path(__file__).resolve().parents[1]
# per pytest session, so that two sessions on one server never drop each other's template
TEMPLATE_DB = f"pw_tmpl_{os.getpid()}"
# two Redis database numbers per session (app, broker); PW_TEST_REDIS_DBS="9,10" by default.
# Under pytest-xdist each worker (gw0, gw1, ...) is a session of its own: the next pair.
_XDIST_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
APP_REDIS_DB, BROKER_REDIS_DB = (
    int(x) + 2 * _XDIST_WORKER for x in os.environ.get("PW_TEST_REDIS_DBS", "9,10").split(",")
)
_counter = itertools.count()


# the URL variable of each service, which the embedded servers serve when it is unset
_URL_VARIABLES = {"PostgreSQL": "DATABASE_URL", "Redis": "REDIS_URL"}


def service_verdict(
    service: str, error: BaseException, *, url_set: bool, embedded_installed: bool, ci: bool
) -> tuple[Literal["fail", "skip"], str]:
    """What an unavailable service means for the tests that need it: fail them or skip them.

    A server named by a URL that does not answer is the environment: skipped locally. With
    no URL the embedded server is started by our own code; if its extra is installed and it
    still cannot be started or reached, that is a regression, which a skip would hide: fail.
    Without the extra it is the environment again. In CI nothing is ever skipped.
    """
    why = f"{service}: {type(error).__name__}: {error}"
    if ci:
        return "fail", f"service unavailable in CI: {why}"
    if not url_set and embedded_installed:
        variable = _URL_VARIABLES[service]
        return "fail", (
            f"the embedded server did not start or answer ({variable} unset, the embedded "
            f"extra installed: a bug, not the environment): {why}"
        )
    return "skip", f"service unavailable: {why}"


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def logged_events(log: Path, name: str) -> list[dict[str, object]]:
    """The JSON log entries of event ``name`` in a process's log file (other lines, such as
    Celery's banner, are skipped)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == name:
            found.append(entry)
    return found


def submit_accounts(accounts: int, items: int, prefix: str) -> list[dict[str, Any]]:
    """One batch of ``items`` per account, accepted and not enqueued (a test drains them)."""
    from payment_worker.dev.samples import make_batches
    from payment_worker.producer.submit import submit_batch

    batches = make_batches(batches=accounts, items=items, accounts=accounts, prefix=prefix)
    for b in batches:
        assert submit_batch(b, enqueue=False).status == "accepted"
    return batches


def _unavailable(service: str, error: BaseException, *, url_set: bool) -> NoReturn:
    installed = False
    if not url_set:
        from payment_worker.embedded.errors import missing_for

        installed = _URL_VARIABLES[service] not in missing_for(None, None)
    verdict, message = service_verdict(
        service,
        error,
        url_set=url_set,
        embedded_installed=installed,
        ci=os.environ.get("CI", "").lower() == "true",
    )
    if verdict == "fail":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _with_db(url: str, dbname: str) -> str:
    """``url`` (libpq form) pointing at database ``dbname``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + dbname))


def _with_redis_db(url: str, db: int) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


@dataclass(frozen=True)
class ServiceUrls:
    """Admin URLs of the PostgreSQL and Redis the tests use."""

    pg_admin: str
    redis_base: str


def _reset_runtime() -> None:
    # the process's runtime was built from the environment the test changes
    runtime.reset()


@pytest.fixture(scope="session")
def service_urls() -> ServiceUrls:
    """Where PostgreSQL and Redis are (env URLs, or the embedded servers), checked alive."""
    env_db = os.environ.get("DATABASE_URL")
    env_redis = os.environ.get("REDIS_URL")
    try:
        if env_db:
            pg = env_db.replace("postgresql+psycopg://", "postgresql://", 1)
        else:
            from payment_worker import embedded

            s = Settings()
            pg = embedded.postgres_url(s.home, s.embedded_pg_os_user)
        with psycopg.connect(pg, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        _unavailable("PostgreSQL", exc, url_set=bool(env_db))
    try:
        if env_redis:
            rurl = env_redis
        else:
            from payment_worker import embedded

            rurl = embedded.redis_url(Settings().home)
        redis.Redis.from_url(rurl, socket_connect_timeout=3).ping()
    except Exception as exc:
        _unavailable("Redis", exc, url_set=bool(env_redis))
    return ServiceUrls(pg_admin=pg, redis_base=rurl)


@pytest.fixture(scope="session")
def template_db(service_urls: ServiceUrls) -> Iterator[str]:
    """A database migrated to head once per session, cloned by every test."""
    from payment_worker.db import migrate

    admin = _with_db(service_urls.pg_admin, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{TEMPLATE_DB}"')
    tmpl_url = _with_db(service_urls.pg_admin, TEMPLATE_DB)
    migrate.upgrade(tmpl_url.replace("postgresql://", "postgresql+psycopg://", 1))
    yield TEMPLATE_DB
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}" WITH (FORCE)')


@dataclass(frozen=True)
class PwEnv:
    """The URLs of one test's private database and Redis databases."""

    database_url: str
    redis_url: str
    broker_url: str
    settings: Settings


@pytest.fixture
def pw_env(
    service_urls: ServiceUrls, template_db: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[PwEnv]:
    """A fresh database (cloned from the template) and flushed Redis dbs, set in the environment.

    Child processes started by the test inherit the environment, so they see the same.
    """
    name = f"pw_t_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    admin = _with_db(service_urls.pg_admin, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    db_url = _with_db(service_urls.pg_admin, name)
    r_url = _with_redis_db(service_urls.redis_base, APP_REDIS_DB)
    b_url = _with_redis_db(service_urls.redis_base, BROKER_REDIS_DB)
    for url in (r_url, b_url):
        redis.Redis.from_url(url).flushdb()
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("REDIS_URL", r_url)
    monkeypatch.setenv("CELERY_BROKER_URL", b_url)
    _reset_runtime()
    try:
        yield PwEnv(db_url, r_url, b_url, Settings())
    finally:
        _reset_runtime()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def rt(pw_env: PwEnv) -> runtime.Runtime:
    """This process's runtime on the test's private database and Redis databases."""
    return runtime.current()


@pytest.fixture
def db_conn(pw_env: PwEnv) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit psycopg connection to the test's database, for assertions."""
    with psycopg.connect(pw_env.database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def redis_client(pw_env: PwEnv) -> redis.Redis:
    """A client of the test's (flushed) application Redis database."""
    return redis.Redis.from_url(pw_env.redis_url)


@pytest.fixture
def closed_port() -> int:
    """A local TCP port nobody listens on: connecting to it is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def pytest_configure(config: pytest.Config) -> None:
    if BROKER_REDIS_DB > 15:  # a Redis server has 16 databases unless configured otherwise
        raise pytest.UsageError(
            f"Redis databases {APP_REDIS_DB},{BROKER_REDIS_DB} for this test process: at most "
            "3 processes (TEST_PROCESSES) from the default PW_TEST_REDIS_DBS=9,10"
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = str(item.fspath)
        if f"{os.sep}integration{os.sep}" in path or f"{os.sep}install{os.sep}" in path:
            item.add_marker(pytest.mark.integration)
        if f"{os.sep}chaos{os.sep}" in path:
            item.add_marker(pytest.mark.chaos)
            item.add_marker(pytest.mark.exclusive)  # kills and pauses with bounds in seconds
