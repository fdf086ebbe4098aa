"""The exporter: Prometheus /metrics on EXPORTER_PORT with what the system *is* right now.

Workers count what they do (ops/metrics.py); the exporter reports state that no worker
process owns: transactions and batches by status, in-doubt and pending items and their
ages, open dead letters, accounts with work waiting (Postgres); messages waiting in the
broker per queue and the delayed ones workers hold (ops/queue_depth.py); workers that answer
a ping (sent beside the scrapes, every EXPORTER_CACHE_SECONDS); and the producers'
submission counts, which short-lived ``payment-worker submit`` processes leave in Redis.
One exporter serves any number of workers.

Reads are cached: one round per ``EXPORTER_CACHE_SECONDS`` at most, whatever the number of
scrapes (two Prometheus servers, reloads). Labels are bounded: statuses, reasons, queues,
results. A source that cannot be read sets ``payment_worker_exporter_source_up{source}`` to
0 and ``payment_worker_exporter_up`` to 0; its series are left out, the others are served.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from payment_worker.db.reports import StateSnapshot, state_snapshot
from payment_worker.domain.statuses import OPEN_TX_STATUSES, BatchStatus, TxStatus
from payment_worker.ops import queue_depth
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import DEAD_LETTER_REASONS, SUBMIT_RESULTS
from payment_worker.redis_keys import RedisKeys

log = get_logger("exporter")

# each round is a handful of aggregates, none over every transaction (db.reports); a slow
# database must not hang a scrape
_STATEMENT_TIMEOUT_MS = 5000
# the queues whose waiting messages are reported (worker/celery_config.py's task_queues)
QUEUES = ("payments", "dlq")
# how long a worker has to answer the exporter's ping
PING_TIMEOUT_SECONDS = 1.0


def _zero_filled(found: Mapping[str, int], keys: Iterable[str]) -> dict[str, int]:
    # every label value is always exported, so a state that empties shows 0, not a gap
    counts = dict.fromkeys((str(k) for k in keys), 0)
    counts.update(found)
    return counts


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(
    family: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: Mapping[str, float],
) -> Metric:
    m = family(name, doc, labels=[label])
    for key, n in values.items():
        m.add_metric([key], n)
    return m


@dataclass(frozen=True)
class Sources:
    """Where the exporter reads: Postgres, the application Redis, the broker, the workers."""

    engine: Engine
    app_redis: redis.Redis
    # None: the broker is not Redis, whose lists the queue depths are read from
    broker: redis.Redis | None
    keys: RedisKeys
    # how many workers answer a ping (None: not asked)
    ping: Callable[[], int] | None = None


def _postgres(engine: Engine, read: list[StateSnapshot]) -> Iterator[Metric]:
    with engine.begin() as conn:
        state = state_snapshot(conn, statement_timeout_ms=_STATEMENT_TIMEOUT_MS)
    read.append(state)
    # without the totals, only the open statuses: a terminal one missing is a gap, never 0
    statuses = TxStatus if state.totals_read else OPEN_TX_STATUSES
    yield _labelled(
        GaugeMetricFamily,
        "payment_worker_transactions",
        "Transactions by current status.",
        "status",
        _zero_filled(state.transactions, statuses),
    )
    yield _gauge(
        "payment_worker_in_doubt_transactions",
        "Transactions whose outcome at the gateway is unknown: status unknown, dispatching"
        " again after a doubt, or left dispatching for over 10 minutes (its sender died).",
        state.in_doubt,
    )
    yield _gauge(
        "payment_worker_oldest_in_doubt_age_seconds",
        "Time since the oldest send in doubt of those transactions (0 if none).",
        state.oldest_in_doubt_age,
    )
    yield _gauge(
        "payment_worker_oldest_pending_age_seconds",
        "Age of the oldest transaction never sent yet (0 if none).",
        state.oldest_pending_age,
    )
    yield _gauge(
        "payment_worker_oldest_open_transaction_age_seconds",
        "Age of the oldest transaction not in a terminal state (0 if none).",
        state.oldest_open_age,
    )
    yield _gauge(
        "payment_worker_accounts_waiting",
        "Accounts with at least one transaction not in a terminal state.",
        state.accounts_waiting,
    )
    yield _gauge(
        "payment_worker_oldest_unsent_age_seconds",
        "Time since the first of an open transaction's steps that have all ended with no"
        " request reaching the gateway (token refused, Redis out of reach, paced; 0 if none).",
        state.oldest_unsent_age,
    )
    yield _gauge(
        "payment_worker_accounts_unsent",
        "Accounts with an open transaction whose latest steps reached nothing at the gateway.",
        state.accounts_unsent,
    )
    yield _labelled(
        GaugeMetricFamily,
        "payment_worker_dead_letters_open",
        "Dead letters not yet resolved, by reason.",
        "reason",
        _zero_filled(state.dead_letters_open, DEAD_LETTER_REASONS),
    )
    yield _gauge(
        "payment_worker_oldest_open_dead_letter_age_seconds",
        "Age of the oldest dead letter not yet resolved (0 if none).",
        state.oldest_open_dead_letter_age,
    )
    yield _labelled(
        CounterMetricFamily,
        "payment_worker_dead_letters_replayed",
        "Dead-letter replays (dlq replay), by reason, from Postgres.",
        "reason",
        _zero_filled(state.dead_letters_replayed, DEAD_LETTER_REASONS),
    )
    yield _labelled(
        CounterMetricFamily,
        "payment_worker_dead_letters_resolved",
        "Dead letters resolved (by hand, or by a replay that finished), by reason.",
        "reason",
        _zero_filled(state.dead_letters_resolved, DEAD_LETTER_REASONS),
    )


def _postgres_totals(read: list[StateSnapshot]) -> Iterator[Metric]:
    # the totals of _postgres's read: their own source, so that a big database whose totals
    # run out of time is seen (source_up 0) without hiding what the alerts read
    if not read:
        raise RuntimeError("Postgres was not read")
    if not read[0].totals_read:
        raise RuntimeError("the totals were not read within the statement timeout")
    yield _labelled(
        GaugeMetricFamily,
        "payment_worker_batches",
        "Batches by current status.",
        "status",
        _zero_filled(read[0].batches, BatchStatus),
    )


def _redis(client: redis.Redis, keys: RedisKeys) -> Iterator[Metric]:
    raw = client.hgetall(keys.submissions())
    counts = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}
    found = {k: n for k, n in counts.items() if k in SUBMIT_RESULTS}
    yield _labelled(
        CounterMetricFamily,
        "payment_worker_submissions",
        "Batch submissions by result, counted by every producer process in Redis.",
        "result",
        _zero_filled(found, SUBMIT_RESULTS),
    )


def _broker(client: redis.Redis) -> Iterator[Metric]:
    counts: dict[str, int] = dict(queue_depth.waiting(client, list(QUEUES)))
    counts["delayed"] = queue_depth.delayed(client)
    yield _labelled(
        GaugeMetricFamily,
        "payment_worker_queue_messages",
        "Messages in the broker: waiting per queue, and delayed (held by workers until due).",
        "queue",
        counts,
    )


def _workers(alive: int | None) -> Iterator[Metric]:
    if alive is None:
        raise RuntimeError("no ping answered yet, or the last one failed")
    yield _gauge(
        "payment_worker_workers_alive",
        "Celery workers that answered the exporter's ping.",
        alive,
    )


class _Pinger(threading.Thread):
    """Pings the workers every ``interval`` seconds beside the scrapes: a ping waits for its
    whole timeout (Celery cannot know how many workers will answer), which must not count
    against a scrape's own timeout. Holds the last count, None after a failure."""

    def __init__(self, ping: Callable[[], int], interval: float) -> None:
        super().__init__(name="exporter-ping", daemon=True)
        self._ping = ping
        self._interval = interval
        self.alive: int | None = None
        self.first = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self.alive = self._ping()
            except Exception as exc:  # reported as source_up{source="workers"} 0
                self.alive = None
                log.warning("exporter_ping_failed", error_class=type(exc).__name__)
            self.first.set()
            time.sleep(self._interval)


class StateCollector(Collector):
    """The exporter's series, read at most once per ``cache_seconds`` from every source."""

    def __init__(self, sources: Sources, cache_seconds: float = 0.0) -> None:
        self._sources = sources
        self._cache_seconds = cache_seconds
        # scrapes from two Prometheus servers must not run the reads twice at once
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._read_at: float | None = None
        self._pinger: _Pinger | None = None

    def describe(self) -> Iterable[Metric]:
        """No description up front: registering must not read anything."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The series of the last read round, read again when older than the cache."""
        with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self._cache_seconds:
                self._cached = self._read()
                self._read_at = time.monotonic()
            yield from self._cached

    def _read(self) -> list[Metric]:
        started = time.perf_counter()
        s = self._sources
        snapshot: list[StateSnapshot] = []
        reads: list[tuple[str, Callable[[], Iterator[Metric]]]] = [
            ("postgres", lambda: _postgres(s.engine, snapshot)),
            ("postgres_totals", lambda: _postgres_totals(snapshot)),
            ("redis", lambda: _redis(s.app_redis, s.keys)),
        ]
        broker = s.broker
        if broker is not None:
            reads.append(("broker", lambda: _broker(broker)))
        if s.ping is not None:
            if self._pinger is None:
                self._pinger = _Pinger(s.ping, max(self._cache_seconds, 1.0))
                self._pinger.start()
                # the first scrape waits for the first answers; later ones never wait
                self._pinger.first.wait(PING_TIMEOUT_SECONDS + 5)
            pinger = self._pinger
            reads.append(("workers", lambda: _workers(pinger.alive)))
        out: list[Metric] = []
        source_up = GaugeMetricFamily(
            "payment_worker_exporter_source_up",
            "1 if the exporter's last read of this source worked, else 0.",
            labels=["source"],
        )
        all_up = True
        for name, read in reads:
            try:
                got = list(read())
            except Exception as exc:  # any failure is reported as a metric, never as a 500
                log.warning(
                    "exporter_read_failed",
                    source=name,
                    error_class=type(exc).__name__,
                    error=str(exc)[:300],
                )
                source_up.add_metric([name], 0)
                # the totals alone missing leave every alerting gauge read: not "down"
                all_up = all_up and name == "postgres_totals"
                continue
            source_up.add_metric([name], 1)
            out += got
        up = _gauge(
            "payment_worker_exporter_up",
            "1 if the exporter's last read of every source worked (the totals aside: their"
            " own source_up), else 0.",
            1 if all_up else 0,
        )
        duration = _gauge(
            "payment_worker_exporter_scrape_duration_seconds",
            "Time the exporter's last read round took.",
            time.perf_counter() - started,
        )
        return [up, source_up, *out, duration]


def celery_ping(timeout: float = PING_TIMEOUT_SECONDS) -> int:
    """Workers that answer Celery's ``ping`` broadcast within ``timeout`` seconds."""
    from payment_worker.worker.celery_app import app

    replies = app.control.ping(timeout=timeout) or []
    return len(replies)


def build_registry(sources: Sources, cache_seconds: float = 0.0) -> CollectorRegistry:
    """A registry holding only the exporter's collector (no worker counters)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(sources, cache_seconds))
    return registry


def serve(port: int, sources: Sources, cache_seconds: float, host: str = "0.0.0.0") -> None:
    """Serve /metrics on ``host:port`` until interrupted. A port that cannot be bound ends
    the command: one line on stderr, exit code 1 (as a worker's METRICS_PORT)."""
    registry = build_registry(sources, cache_seconds)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        print(
            f"payment-worker exporter: cannot serve metrics on {host}:{port}: "
            f"{exc.strerror or exc} (EXPORTER_PORT, or --port)",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    log.info("exporter_listening", host=host, port=server.server_port)
    try:
        while thread.is_alive():
            thread.join(timeout=1.0)
    finally:
        server.shutdown()
