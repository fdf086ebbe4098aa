"""Running the alembic migrations from code (``payment-worker db upgrade``).

The alembic environment ships inside the package (``payment_worker/migrations``), so an
installed wheel migrates from any working directory; the repository's ``alembic.ini`` points
at the same folder for developers who run ``alembic`` by hand.

A migration runs beside working drains (a rolling deploy). Two rules keep it from stopping
them or another migrator (``migrations/env.py``):

* one migrator at a time: a transaction-scoped advisory lock, so two deploy hosts running
  ``db upgrade`` at once take turns and the second finds the schema at head;
* a migration waits at most ``MIGRATION_LOCK_TIMEOUT_MS`` for a table lock: while it waits,
  every statement on that table queues behind it. When it gives up, its whole run rolls
  back (nothing is half-applied) and is tried again after a backoff with jitter, for up to
  ``MIGRATION_RETRY_SECONDS``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources

from alembic import command
from alembic.config import Config
from psycopg import errors as pg_errors
from sqlalchemy.exc import OperationalError

from payment_worker.domain.retry import Backoff
from payment_worker.errors import PaymentWorkerError
from payment_worker.ops.logging import get_logger
from payment_worker.settings import load_settings

log = get_logger("migrations")

ADVISORY_LOCK_KEY = 0x7061796D656E74  # "payment": one migrator per database at a time
"""The key of the advisory lock a migration run holds (``pg_advisory_xact_lock``)."""

_BACKOFF = Backoff(base=0.5, cap=10.0)


class MigrationLockTimeout(PaymentWorkerError):
    """The migrations kept meeting table locks held by other sessions past
    ``MIGRATION_RETRY_SECONDS``; every try rolled back, so the schema is as it was."""


def alembic_config(url: str | None = None, *, lock_timeout_ms: int | None = None) -> Config:
    """The alembic config of the packaged migrations for the database at ``url`` (SQLAlchemy
    form); without one, env.py reads the settings. ``lock_timeout_ms`` bounds each wait for
    a table lock (None: ``MIGRATION_LOCK_TIMEOUT_MS``; 0: no bound)."""
    cfg = Config()
    # the folder inside the installed package, wherever the command runs from
    cfg.set_main_option("script_location", str(resources.files("payment_worker") / "migrations"))
    if url is not None:
        cfg.attributes["url"] = url
    if lock_timeout_ms is not None:
        cfg.attributes["lock_timeout_ms"] = lock_timeout_ms
    return cfg


def upgrade(
    url: str | None = None,
    revision: str = "head",
    *,
    lock_timeout_ms: int | None = None,
    retry_seconds: float | None = None,
) -> None:
    """``alembic upgrade head``; running it twice changes nothing. Tried again after a lock
    timeout (see the module); None takes the setting."""
    _with_retries(lambda cfg: command.upgrade(cfg, revision), url, lock_timeout_ms, retry_seconds)


def downgrade(
    url: str | None = None,
    revision: str = "base",
    *,
    lock_timeout_ms: int | None = None,
    retry_seconds: float | None = None,
) -> None:
    """``alembic downgrade``, tried again after a lock timeout like :func:`upgrade`."""
    _with_retries(lambda cfg: command.downgrade(cfg, revision), url, lock_timeout_ms, retry_seconds)


def current(url: str | None = None) -> None:
    """Print the current revision (without waiting behind a running migration)."""
    cfg = alembic_config(url)
    cfg.attributes["read_only"] = True
    command.current(cfg)


def _with_retries(
    run: Callable[[Config], None],
    url: str | None,
    lock_timeout_ms: int | None,
    retry_seconds: float | None,
) -> None:
    if lock_timeout_ms is None or retry_seconds is None:
        s = load_settings()
        if lock_timeout_ms is None:
            lock_timeout_ms = s.migration_lock_timeout_ms
        if retry_seconds is None:
            retry_seconds = s.migration_retry_seconds
    cfg = alembic_config(url, lock_timeout_ms=lock_timeout_ms)
    deadline = time.monotonic() + retry_seconds
    attempt = 0
    while True:
        attempt += 1
        try:
            run(cfg)
            return
        except OperationalError as exc:
            if not isinstance(exc.orig, pg_errors.LockNotAvailable):
                raise
            wait = _BACKOFF.delay(attempt, floor=0.1)
            if time.monotonic() + wait > deadline:
                raise MigrationLockTimeout(
                    f"the migrations met table locks held by other sessions {attempt} "
                    f"time(s) in {retry_seconds:g}s (each wait bounded by "
                    f"MIGRATION_LOCK_TIMEOUT_MS={lock_timeout_ms}); nothing was changed: "
                    "run it again when the long transactions on those tables have ended"
                ) from None
            # the statement that waited: which table the blocker holds
            statement = str(exc.statement or "").strip().splitlines()[:1]
            log.warning(
                "migration_lock_timeout",
                attempt=attempt,
                retry_in=round(wait, 2),
                statement=statement[0][:120] if statement else None,
            )
            time.sleep(wait)
