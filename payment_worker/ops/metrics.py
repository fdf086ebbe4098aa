"""Every Prometheus metric of the service, in one place.

Names are in base units with ``_total`` counters; labels are bounded (never an account,
batch or payment id). docs/metrics.md lists them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# --- account lock and fencing -------------------------------------------------------------
LOCK_ACQUIRE_SECONDS = Histogram(
    "payment_worker_lock_acquire_seconds",
    "Time to acquire an account lock (including fencing).",
    ["result"],
    buckets=_LATENCY_BUCKETS,
)
LOCK_CONTENTION = Counter(
    "payment_worker_lock_contention_total", "Lock attempts that found the account lock held by another owner."
)
LOCK_RENEWALS = Counter("payment_worker_lock_renewals_total", "Watchdog renewals of account locks.", ["result"])
LOCK_LOST = Counter("payment_worker_lock_lost_total", "Account locks lost while held.", ["reason"])
LOCK_RELEASE_NOT_OWNER = Counter(
    "payment_worker_lock_release_not_owner_total", "Releases that found the lock no longer ours (no-op)."
)
FENCING_REJECTIONS = Counter(
    "payment_worker_fencing_rejections_total", "State writes rejected because a newer fencing token exists."
)

# --- gateway ----------------------------------------------------------------------------
GATEWAY_REQUESTS = Counter(
    "payment_worker_gateway_requests_total",
    "Gateway requests by endpoint and classified outcome.",
    ["endpoint", "outcome"],
)
GATEWAY_REQUEST_SECONDS = Histogram(
    "payment_worker_gateway_request_seconds",
    "Gateway request latency.",
    ["endpoint"],
    buckets=_LATENCY_BUCKETS,
)
GATEWAY_TOKEN_REFRESHES = Counter(
    "payment_worker_gateway_token_refreshes_total", "Access tokens fetched from the gateway.", ["result"]
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
    "payment_worker_transactions_finished_total", "Transactions that reached a terminal state.", ["status"]
)
TRANSACTION_RETRIES = Counter(
    "payment_worker_transaction_retries_total", "Transactions scheduled for another attempt.", ["reason"]
)
LOOKUPS = Counter("payment_worker_gateway_lookups_total", "Lookups of unknown outcomes.", ["result"])
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
    "payment_worker_task_executions_total", "process_account_batch executions by result.", ["result"]
)
BATCH_SECONDS = Histogram(
    "payment_worker_batch_processing_seconds",
    "Time one task spent on one account's batches.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
SWEEPS = Counter("payment_worker_sweeps_total", "Sweeper passes.", ["result"])
SWEEP_REENQUEUED = Counter("payment_worker_sweep_reenqueued_total", "Batches re-enqueued by the sweeper.")
IN_PROGRESS = Gauge(
    "payment_worker_batches_in_progress",
    "Batches being processed by this process.",
    multiprocess_mode="livesum",
)

# --- producer -------------------------------------------------------------------------------
BATCHES_SUBMITTED = Counter(
    "payment_worker_batches_submitted_total", "Batches submitted, by result.", ["status"]
)
SUBMIT_DUPLICATES = Counter(
    "payment_worker_submit_duplicates_total", "Duplicate submissions caught, by layer.", ["layer"]
)
ENQUEUE_FAILURES = Counter(
    "payment_worker_enqueue_failures_total", "Broker publishes that failed (the sweeper enqueues later)."
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
LOCK_TAKEOVERS = Counter(
    "payment_worker_lock_takeovers_total",
    "Account locks taken from a holder process whose liveness key was gone (by task or sweeper).",
    ["by"],
)
HANDED_BACK = Counter(
    "payment_worker_handed_back_total",
    "Accounts released and re-enqueued at once by a warm shutdown.",
)
