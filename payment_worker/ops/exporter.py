"""The exporter: Prometheus /metrics on EXPORTER_PORT with gauges read from Postgres per scrape.

Workers count what they do (ops/metrics.py); the exporter reports what *is*: how
many transactions sit in each state, open dead letters, and how old the oldest unfinished
transaction is. It reads Postgres on every scrape (a custom collector), so it holds no
state, and one exporter serves any number of workers. Labels are bounded: statuses only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from payment_worker.db.reports import state_snapshot
from payment_worker.domain.statuses import BatchStatus, DeadReason, TxStatus
from payment_worker.ops.logging import get_logger

log = get_logger("exporter")

# each scrape is a handful of index-backed aggregates; a slow database must not hang it
_STATEMENT_TIMEOUT_MS = 5000


def _zero_filled(found: Mapping[str, int], statuses: Iterable[str]) -> dict[str, int]:
    # every status is always exported, so a state that empties shows 0, not a gap
    counts = dict.fromkeys((str(s) for s in statuses), 0)
    counts.update(found)
    return counts


class PostgresStateCollector(Collector):
    """Gauges of the service's state, queried from Postgres on each collect()."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # scrapes from two Prometheus servers must not run the queries twice at once
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        """No description up front: registering must not query the database."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Query Postgres and yield the gauges; a failed query sets payment_worker_exporter_up to 0."""
        started = time.perf_counter()
        up = GaugeMetricFamily(
            "payment_worker_exporter_up", "1 if the last scrape could read Postgres, else 0."
        )
        try:
            with self._lock, self._engine.begin() as conn:
                state = state_snapshot(conn, statement_timeout_ms=_STATEMENT_TIMEOUT_MS)
            tx = _zero_filled(state.transactions, TxStatus)
            batches = _zero_filled(state.batches, BatchStatus)
            dead_open, oldest = state.dead_letters_open, state.oldest_open_age
            reasons = [*(r.value for r in DeadReason), "task_crashed"]
            replayed = _zero_filled(state.dead_letters_replayed, reasons)
            resolved = _zero_filled(state.dead_letters_resolved, reasons)
        except Exception as exc:  # any failure is reported as a metric, never as a 500
            log.warning("scrape_failed", error_class=type(exc).__name__, error=str(exc)[:300])
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up

        g = GaugeMetricFamily(
            "payment_worker_transactions", "Transactions by current status.", labels=["status"]
        )
        for status, n in tx.items():
            g.add_metric([status], n)
        yield g
        g = GaugeMetricFamily(
            "payment_worker_batches", "Batches by current status.", labels=["status"]
        )
        for status, n in batches.items():
            g.add_metric([status], n)
        yield g
        yield GaugeMetricFamily(
            "payment_worker_dead_letters_open", "Dead letters not yet resolved.", value=dead_open
        )
        yield GaugeMetricFamily(
            "payment_worker_oldest_open_dead_letter_age_seconds",
            "Age of the oldest dead letter not yet resolved (0 if none).",
            value=state.oldest_open_dead_letter_age,
        )
        c = CounterMetricFamily(
            "payment_worker_dead_letters_replayed",
            "Dead-letter replays (dlq replay), by reason, from Postgres.",
            labels=["reason"],
        )
        for reason, n in replayed.items():
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily(
            "payment_worker_dead_letters_resolved",
            "Dead letters resolved (by hand, or by a replay that finished), by reason.",
            labels=["reason"],
        )
        for reason, n in resolved.items():
            c.add_metric([reason], n)
        yield c
        yield GaugeMetricFamily(
            "payment_worker_oldest_open_transaction_age_seconds",
            "Age of the oldest transaction not in a terminal state (0 if none).",
            value=oldest,
        )
        yield GaugeMetricFamily(
            "payment_worker_exporter_scrape_duration_seconds",
            "Time the last scrape spent reading Postgres.",
            value=time.perf_counter() - started,
        )


def build_registry(engine: Engine) -> CollectorRegistry:
    """A registry holding only the Postgres state collector (no worker counters)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PostgresStateCollector(engine))
    return registry


def serve(port: int, engine: Engine, host: str = "0.0.0.0") -> None:
    """Serve /metrics on ``host:port`` until interrupted."""
    server, thread = start_http_server(port, addr=host, registry=build_registry(engine))
    log.info("exporter_listening", host=host, port=server.server_port)
    try:
        while thread.is_alive():
            thread.join(timeout=1.0)
    finally:
        server.shutdown()
