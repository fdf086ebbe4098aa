"""Watching a worker's Postgres connections from the outside, for the dbpool tests.

:class:`BackendWatch` samples ``pg_stat_activity`` in a thread: the backends named after one
process (``application_name``, see ``db.engine.application_name``) and the accounts that have a
chunk in flight (claimed ``dispatching`` rows). :func:`terminate_backends` is a real admin
shutdown of a process's connections (``pg_terminate_backend``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import psycopg


def name_pattern(pid: int) -> str:
    """The ``LIKE`` pattern of one process's ``application_name``."""
    return f"payment-worker:{pid}@%"


@dataclass
class BackendWatch:
    """Samples, every ``interval`` seconds, one process's backends and the accounts in flight."""

    admin_url: str  # any database of the server: pg_stat_activity is cluster-wide
    database_url: str  # the test's database (its transactions table)
    pid: int
    interval: float = 0.02
    backends: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        with (
            psycopg.connect(self.admin_url, autocommit=True) as admin,
            psycopg.connect(self.database_url, autocommit=True) as db,
        ):
            while not self._stop.wait(self.interval):
                row = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                    (name_pattern(self.pid),),
                ).fetchone()
                self.backends.append(int(row[0]) if row else 0)
                row = db.execute(
                    "SELECT count(DISTINCT account_id) FROM transactions"
                    " WHERE status = 'dispatching'"
                ).fetchone()
                self.in_flight.append(int(row[0]) if row else 0)

    def __enter__(self) -> BackendWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def terminate_backends(admin_url: str, pid: int) -> int:
    """``pg_terminate_backend`` every backend of process ``pid``; returns how many."""
    with psycopg.connect(admin_url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
            (name_pattern(pid),),
        ).fetchall()
    return sum(1 for (ok,) in rows if ok)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A process's ``/metrics`` as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_terminal(database_url: str, total: int, timeout: float) -> dict[str, int]:
    """Poll until ``total`` transactions are terminal; returns the counts by status. A new
    connection per poll, so a server restart in between costs one poll."""
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(database_url, autocommit=True, connect_timeout=5) as db:
                rows = db.execute("SELECT status, count(*) FROM transactions GROUP BY 1").fetchall()
        except psycopg.OperationalError:
            time.sleep(0.25)
            continue
        counts = {str(s): int(n) for s, n in rows}
        if sum(counts.get(s, 0) for s in ("succeeded", "failed", "dead")) >= total:
            return counts
        time.sleep(0.25)
    return counts
