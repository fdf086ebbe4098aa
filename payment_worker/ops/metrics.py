"""Every Prometheus metric of the service, in one place, and the worker's ``/metrics``.

Names are in base units with ``_total`` counters; labels are bounded (never an account,
batch or payment id). docs/metrics.md lists them. The label values alerts and panels use
are created at import (:func:`preset`), so a series exists at 0 from the start and
``increase(...) > 0`` sees the first event after a restart.

A Celery worker whose pool forks (prefork) runs prometheus-client's multiprocess mode
(:mod:`payment_worker.ops.multiprocess` switches it on before this module is imported; a
threads or solo worker is one process and keeps the plain registry): every Gauge here needs
a ``multiprocess_mode`` (``livesum``: the live processes' values added up), never the
default ``all`` (one series per pid).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from payment_worker.db.retry import REASONS
from payment_worker.domain.statuses import DeadReason
from payment_worker.gateway.outcomes import Outcome
from payment_worker.ops import multiprocess

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# --- account lock and fencing -------------------------------------------------------------
LOCK_ACQUIRE_SECONDS = Histogram(
    "payment_worker_lock_acquire_seconds",
    "Time to acquire an account lock (with its fencing token when the acquire takes one).",
    ["result"],
    buckets=_LATENCY_BUCKETS,
)
LOCK_CONTENTION = Counter(
    "payment_worker_lock_contention_total",
    "Lock attempts that found the account lock held by another owner.",
)
LOCK_RENEWALS = Counter(
    "payment_worker_lock_renewals_total", "Watchdog renewals of account locks.", ["result"]
)
LOCK_LOST = Counter("payment_worker_lock_lost_total", "Account locks lost while held.", ["reason"])
LOCK_RELEASE_NOT_OWNER = Counter(
    "payment_worker_lock_release_not_owner_total",
    "Releases that found the lock no longer ours (no-op).",
)
FENCING_REJECTIONS = Counter(
    "payment_worker_fencing_rejections_total",
    "State writes rejected because a newer fencing token exists.",
)

# --- gateway ----------------------------------------------------------------------------
GATEWAY_REQUESTS = Counter(
    "payment_worker_gateway_requests_total",
    "Gateway requests by endpoint and classified outcome.",
    ["endpoint", "outcome"],
)
# what a payment or lookup request the client itself held back waited for: the account's
# pacing slot or cooldown, Redis (the shared token or the pacing bucket), a token (requests
# paused after failures, or another process's refresh waited for too long). Not a gateway
# answer, so not in GATEWAY_REQUESTS (its error ratio would page for a healthy gateway); a
# refused connection, or a token request refused or unanswered, is the gateway's and stays
GATEWAY_NOT_SENT_REASONS = ("paced", "redis_error", "token")
GATEWAY_NOT_SENT = Counter(
    "payment_worker_gateway_not_sent_total",
    "Payment and lookup requests the client held back, by endpoint and what they waited for.",
    ["endpoint", "reason"],
)
GATEWAY_REQUEST_SECONDS = Histogram(
    "payment_worker_gateway_request_seconds",
    "Gateway request latency.",
    ["endpoint"],
    buckets=_LATENCY_BUCKETS,
)
GATEWAY_TOKEN_REFRESHES = Counter(
    "payment_worker_gateway_token_refreshes_total",
    "Access tokens fetched from the gateway.",
    ["result"],
)
GATEWAY_RATE_LIMITED = Counter(
    "payment_worker_gateway_rate_limited_total", "HTTP 429 answers from the gateway.", ["endpoint"]
)
GATEWAY_UNAUTHORIZED = Counter(
    "payment_worker_gateway_unauthorized_total",
    "HTTP 401 invalid_token answers (each leads to one compare-and-refresh).",
    ["endpoint"],
)
GATEWAY_PACING_WAIT_SECONDS = Histogram(
    "payment_worker_gateway_pacing_wait_seconds",
    "Time spent waiting for the per-account request quota.",
    buckets=_LATENCY_BUCKETS,
)

# --- processing ---------------------------------------------------------------------------
TRANSACTIONS_FINISHED = Counter(
    "payment_worker_transactions_finished_total",
    "Transactions that reached a terminal state.",
    ["status"],
)
TRANSACTION_RETRIES = Counter(
    "payment_worker_transaction_retries_total",
    "Transactions scheduled for another attempt.",
    ["reason"],
)
LOOKUPS = Counter(
    "payment_worker_gateway_lookups_total", "Lookups of unknown outcomes.", ["result"]
)
DEAD_LETTERS = Counter("payment_worker_dead_letters_total", "Dead-letter rows written.", ["reason"])
# dlq replay/resolve, counted where they run. The dlq command is a short process that serves
# no /metrics, so the exporter reports the same names from Postgres (the totals that count)
DEAD_LETTERS_REPLAYED = Counter(
    "payment_worker_dead_letters_replayed_total", "Dead letters put back by dlq replay.", ["reason"]
)
DEAD_LETTERS_RESOLVED = Counter(
    "payment_worker_dead_letters_resolved_total", "Dead letters resolved by hand.", ["reason"]
)
TASK_EXECUTIONS = Counter(
    "payment_worker_task_executions_total",
    "process_account_batch executions by result.",
    ["result"],
)
BATCH_SECONDS = Histogram(
    "payment_worker_batch_processing_seconds",
    "Time one task spent on one account's batches.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
SWEEPS = Counter("payment_worker_sweeps_total", "Sweeper passes.", ["result"])
SWEEP_SECONDS = Histogram(
    "payment_worker_sweep_seconds",
    "Length of one sweeper pass (its first query reads every due open item).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
SWEEP_REENQUEUED = Counter(
    "payment_worker_sweep_reenqueued_total", "Batches re-enqueued by the sweeper."
)
IN_PROGRESS = Gauge(
    "payment_worker_batches_in_progress",
    "Batches being processed by this process.",
    multiprocess_mode="livesum",
)

# --- dbpool: database connections and transient errors ---------------------------------------
DB_RETRIES = Counter(
    "payment_worker_db_retries_total",
    "Database statements retried on a fresh connection after a transient error.",
    ["reason"],
)
# its label values: the reasons db.retry may return (one list, kept there)
DB_RETRY_REASONS = REASONS

# --- producer -------------------------------------------------------------------------------
BATCHES_SUBMITTED = Counter(
    "payment_worker_batches_submitted_total", "Batches submitted, by result.", ["status"]
)
SUBMIT_DUPLICATES = Counter(
    "payment_worker_submit_duplicates_total", "Duplicate submissions caught, by layer.", ["layer"]
)
ENQUEUE_FAILURES = Counter(
    "payment_worker_enqueue_failures_total",
    "Broker publishes that failed (the sweeper enqueues later).",
)


# --- recovery (issue 15: liveness, takeover, hand-back) ----------------------------------------
LIVENESS_BEATS = Counter(
    "payment_worker_liveness_beats_total",
    "Heartbeats of this process's liveness key (ok, error).",
    ["result"],
)
LIVENESS_LAPSES = Counter(
    "payment_worker_liveness_lapses_total",
    "Times this process's liveness key may have lapsed (paused, Redis unreachable or flushed): "
    "every lock it held counts as lost.",
)
# how close a busy process comes to a lapse: the lapse is a gap of LIVENESS_TTL_MS -
# LOCK_SAFETY_MARGIN_MS (2 s by default); the beats are LIVENESS_INTERVAL_MS (0.5 s) apart
LIVENESS_BEAT_GAP_SECONDS = Histogram(
    "payment_worker_liveness_beat_gap_seconds",
    "From one successful heartbeat's send to the next one's reply: LIVENESS_INTERVAL_MS when "
    "the process keeps up; LIVENESS_TTL_MS - LOCK_SAFETY_MARGIN_MS or more is a lapse.",
    buckets=(0.6, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 5.0),
)
LOCK_TAKEOVERS = Counter(
    "payment_worker_lock_takeovers_total",
    "Account locks taken from a holder process whose liveness key was gone (by task or sweeper).",
    ["by"],
)
HANDED_BACK = Counter(
    "payment_worker_handed_back_total",
    "Accounts released and re-enqueued at once by a warm shutdown.",
)

# --- label values created at 0 (what alerts and panels select on) -------------------------
GATEWAY_ENDPOINTS = ("create", "lookup")
LOCK_LOST_REASONS = ("expired", "stolen", "unreachable", "deadline", "stalled", "liveness")
DEAD_LETTER_REASONS = (*(r.value for r in DeadReason), "task_crashed")
TASK_RESULTS = (
    "processed",
    "idle",
    "contended",
    "lock_lost",
    "fenced_out",
    "missing",
    "db_unavailable",
    "redis_unavailable",
)
SUBMIT_RESULTS = ("accepted", "duplicate", "rejected")

_PRESETS: tuple[tuple[MetricWrapperBase, tuple[tuple[str, ...], ...]], ...] = (
    (LOCK_ACQUIRE_SECONDS, tuple((r,) for r in ("acquired", "busy", "timeout", "error"))),
    (LOCK_RENEWALS, (("ok",), ("lost",), ("error",))),
    (LOCK_LOST, tuple((r,) for r in LOCK_LOST_REASONS)),
    (GATEWAY_REQUESTS, tuple((e, o.value) for e in GATEWAY_ENDPOINTS for o in Outcome)),
    (GATEWAY_NOT_SENT, tuple((e, r) for e in GATEWAY_ENDPOINTS for r in GATEWAY_NOT_SENT_REASONS)),
    (GATEWAY_REQUEST_SECONDS, tuple((e,) for e in GATEWAY_ENDPOINTS)),
    (GATEWAY_TOKEN_REFRESHES, (("ok",), ("transport_error",))),
    (GATEWAY_RATE_LIMITED, tuple((e,) for e in GATEWAY_ENDPOINTS)),
    (GATEWAY_UNAUTHORIZED, tuple((e,) for e in GATEWAY_ENDPOINTS)),
    (TRANSACTIONS_FINISHED, (("succeeded",), ("failed",), ("dead",))),
    (TRANSACTION_RETRIES, (("retryable",), ("unknown",))),
    (LOOKUPS, tuple((o.value,) for o in Outcome)),
    (DEAD_LETTERS, tuple((r,) for r in DEAD_LETTER_REASONS)),
    (DEAD_LETTERS_REPLAYED, tuple((r,) for r in DEAD_LETTER_REASONS)),
    (DEAD_LETTERS_RESOLVED, tuple((r,) for r in DEAD_LETTER_REASONS)),
    (TASK_EXECUTIONS, tuple((r,) for r in TASK_RESULTS)),
    (DB_RETRIES, tuple((r,) for r in DB_RETRY_REASONS)),
    (LIVENESS_BEATS, (("ok",), ("error",))),
    (LOCK_TAKEOVERS, (("task",), ("sweeper",))),
    (SWEEPS, (("ok",), ("skipped",), ("broker_error",))),
    (BATCHES_SUBMITTED, tuple((r,) for r in SUBMIT_RESULTS)),
    (SUBMIT_DUPLICATES, (("redis",), ("postgres",))),
)


def preset(presets: Iterable[tuple[MetricWrapperBase, tuple[tuple[str, ...], ...]]]) -> None:
    """Create each labelled child at 0: the series exists before its first event."""
    for metric, values in presets:
        for labels in values:
            metric.labels(*labels)


preset(_PRESETS)


# --- the worker's /metrics -----------------------------------------------------------------
def _worker_registry() -> CollectorRegistry:
    if not multiprocess.enabled():
        return REGISTRY  # the process's own counters (not a Celery worker, or an old setup)
    from prometheus_client import multiprocess as mp

    class LiveCollector(mp.MultiProcessCollector):
        """Merges every process's files. First, a child that died without its shutdown hook
        (SIGKILL, OOM) has its live gauges dropped, so it stops counting as busy; and the
        counters of ended children are folded into one archive file per type."""

        def __init__(self, registry: CollectorRegistry) -> None:
            super().__init__(registry)  # type: ignore[no-untyped-call]
            self._lock = threading.Lock()

        def collect(self) -> Iterable[Metric]:
            with self._lock:
                for entry in os.scandir(self._path):
                    pid = entry.name.removesuffix(".db").rpartition("_")[2]
                    live = entry.name.startswith("gauge_live") and pid.isdigit()
                    if live and not multiprocess.pid_alive(int(pid)):
                        mp.mark_process_dead(int(pid), self._path)  # type: ignore[no-untyped-call]
                multiprocess.compact_dead(Path(self._path))
                found: Iterable[Metric] = super().collect()  # type: ignore[no-untyped-call]
                return found

    registry = CollectorRegistry()
    LiveCollector(registry)
    return registry


def serve_worker_metrics(port: int, host: str = "") -> None:
    """The worker's ``/metrics`` on ``port`` (0: off), served by the worker's main process
    for all its pool processes. A port that cannot be bound ends the worker: one line on
    stderr, exit code 1 (a second worker on the host needs its own METRICS_PORT)."""
    if not port:
        return
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=host or "0.0.0.0", registry=_worker_registry())
    except OSError as exc:
        print(
            f"payment-worker: cannot serve metrics on METRICS_PORT={port}: {exc.strerror or exc}"
            " (give each worker on a host its own port, or 0 to turn metrics off)",
            file=sys.stderr,
        )
        multiprocess.remove_owned_dir()
        raise SystemExit(1) from None


def process_exited(pid: int | None = None) -> None:
    """A pool process ends: its live gauges stop counting (its counters stay summed in)."""
    if multiprocess.enabled():
        from prometheus_client import multiprocess as mp

        mp.mark_process_dead(pid or os.getpid())  # type: ignore[no-untyped-call]
