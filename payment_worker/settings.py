"""Every knob of the service, read from environment variables (pydantic-settings).

The configuration reference is docs/configuration.md; keep the two in step.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from payment_worker.domain.batch_schema import check_identifier
from payment_worker.ops.redaction import mask_url

# threads per worker process when WORKER_CONCURRENCY is unset: enough accounts in flight for
# a gateway that answers in about a second (measured, docs/benchmarks.md, issue 13: at 500,
# two processes reach 1,000 accounts in flight only when every slot is busy at the same
# instant; since messages are taken in blocks the consumer fills every slot, and 1,000
# rather than 750 took scenario 5, 2,000 accounts at 1 s, from 716 to 1,139 items/s with
# scenarios 1, 3 and 4 unchanged, for about 25 MB more RSS per process)
THREADS_CONCURRENCY = 1000
# the longest wait between two tries of the task that writes a crash's dead letter while
# Postgres is down (worker/dlq.py): a countdown, so half the visibility timeout at most
DEAD_LETTER_RETRY_MAX_SECONDS = 300

_PG_SCHEMES = {"postgresql", "postgres", "postgresql+psycopg"}
_REDIS_SCHEMES = {"redis", "rediss", "unix"}
# kombu's Redis transport has no unix:// URLs (its own spelling is redis+socket://, which
# redis-py, reading the same broker for the sweeper, does not know)
_BROKER_SCHEMES = {"redis", "rediss"}


def _check_url(value: str | None, schemes: set[str], what: str) -> str | None:
    if value is None or value == "":
        return None
    parts = urlsplit(value)
    # the error line shows the value, never its password
    shown = mask_url(value)
    if parts.scheme not in schemes:
        raise ValueError(f"expected a {what} URL ({', '.join(sorted(schemes))}), got {shown!r}")
    if parts.scheme != "unix" and not (parts.hostname or "host=" in parts.query):
        raise ValueError(f"{what} URL {shown!r} names no host")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"{what} URL {shown!r} has a bad port") from exc
    return value


# the gateway simulator's secret: only ever used for a gateway on this machine
SIMULATOR_SECRET = "sim-secret"


def is_local_gateway(url: str) -> bool:
    """True when ``url``'s host is a loopback address (the local simulator), where
    GATEWAY_CLIENT_SECRET may be left unset."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Service settings; field names are the environment variables, upper-cased."""

    # no inf or nan in any float: SWEEPER_INTERVAL=inf would end the repair thread at its
    # first wait, LOCK_MAX_STALL_SECONDS=inf switch the stall bound off without a word
    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, allow_inf_nan=False)

    # --- services -------------------------------------------------------------------------
    database_url: str | None = None
    redis_url: str | None = None
    celery_broker_url: str | None = None
    payment_worker_home: Path = Path("./.payment-worker")
    # the OS user the embedded PostgreSQL runs as when started by root (created if missing)
    embedded_pg_os_user: str = Field("pgserver", min_length=1, max_length=32)
    redis_key_prefix: str = "pw"

    # --- database connections (docs/configuration.md) ---------------------------------------
    # sent at connect time (libpq options); 0: not sent, the server's or role's value holds
    db_statement_timeout_ms: int = Field(30_000, ge=0)
    db_lock_timeout_ms: int = Field(10_000, ge=0)
    # TCP keepalives (libpq keepalives_*): a silent server or a dropped network is noticed
    db_keepalives_idle: int = Field(30, ge=1)
    db_keepalives_interval: int = Field(10, ge=1)
    db_keepalives_count: int = Field(3, ge=1)
    # how long sent data may stay unacknowledged before the connection is dropped; 0: the OS's
    db_tcp_user_timeout_ms: int = Field(60_000, ge=0)

    # --- database pool, PgBouncer, transient errors (dbpool; docs/configuration.md) --------
    # Postgres connections per process, never exceeded (no overflow); statements check one
    # out and give it back, none is held across a gateway call
    db_pool_size: int = Field(10, ge=1, le=1000)
    # how long a statement waits for a free pooled connection before it fails (transient:
    # the drain retries it)
    db_pool_timeout: float = Field(5.0, gt=0)
    # the database is reached through PgBouncer in transaction pooling mode: no startup
    # options (the timeouts come from the role), no prepared statements
    db_pgbouncer: bool = False
    # a drain retries transient database errors (disconnects, admin shutdown, failover,
    # serialization failures, pool timeouts) for this long, then hands the account back
    db_retry_max_seconds: float = Field(10.0, gt=0)
    # a migration waits this long for a table lock, then gives up and tries again: while it
    # waits, every statement on that table queues behind it (the drains included). 0: waits
    # without a bound
    migration_lock_timeout_ms: int = Field(2_000, ge=0)
    # how long `db upgrade` / `db downgrade` keep trying after such a lock timeout (backoff
    # with jitter) before they stop with nothing changed
    migration_retry_seconds: float = Field(300.0, ge=0)

    # --- gateway --------------------------------------------------------------------------
    gateway_url: str = "http://127.0.0.1:8700"
    # required unless GATEWAY_URL is on a loopback host (the simulator's secret is used then)
    gateway_client_secret: SecretStr | None = Field(None, validate_default=True)
    gateway_connect_timeout: float = Field(2.0, gt=0)
    gateway_read_timeout: float = Field(5.0, gt=0)
    # no longer read: each worker thread keeps one gateway connection (gateway/connection.py);
    # accepted so that configurations that set it still load
    gateway_pool_size: int = Field(20, ge=1)
    # per-account request quota, requests/s; overrides: JSON object {"acct-1": 5}
    gateway_rate_per_second: float = Field(20.0, gt=0)
    # NoDecode: decoded by the validator below, so that bad JSON is one line naming the
    # variable (pydantic-settings' own decoding raised past it: a traceback)
    # strict: `true` is no rate (lax mode read it as 1.0)
    gateway_rate_overrides: Annotated[
        dict[str, Annotated[float, Field(gt=0, strict=True)]], NoDecode
    ] = Field(default_factory=dict)
    # refresh a token ahead of expiry; the lead is drawn between half and all of this share of
    # its lifetime (jitter, so many accounts do not refresh together). 0.1 measured best:
    # 1.00 tokens per account per TTL, no 401 (docs/benchmarks.md)
    gateway_token_refresh_fraction: float = Field(0.1, gt=0, lt=1)
    # longest wait for an account's pacing slot (or 429 cooldown) before a call gives up (RETRY)
    gateway_pacing_max_wait: float = Field(10.0, gt=0)
    # --- gateway pacing leases (issue 13, hotpath) ---
    # pacing slots are leased from Redis in blocks of up to rate x this many seconds (one
    # slot when that is below 2) and spent locally: one script per block, not per request;
    # the holder gives the rest back when it is done with the account, so a window longer
    # than a request at real latency costs the next holder nothing (0.5: measured against
    # 0.1 and 1.0, docs/benchmarks.md)
    gateway_pacing_lease_seconds: float = Field(0.5, ge=0, le=1.0)

    # --- account lock and fencing ---------------------------------------------------------
    # floors: below them a renewal, a heartbeat or a pass runs so often that it is a busy
    # loop against Redis or Postgres, not a setting (the tests' shortest: 600 ms, 0.5 s)
    lock_ttl_ms: int = Field(30_000, ge=500)
    lock_safety_margin_ms: int = Field(1_000, ge=0)
    lock_wait_timeout: float = Field(0.0, ge=0)
    # the watchdog stops renewing a lock whose holder reported no progress for this long (a
    # holder blocked in Postgres or in a hung call): the lock expires and another worker
    # takes the account over behind the fence
    lock_max_stall_seconds: float = Field(120.0, gt=0)

    # --- retries, lookups, dead letters ---------------------------------------------------
    retry_max_attempts: int = Field(8, ge=1)
    retry_base_delay: float = Field(1.0, gt=0)
    retry_max_delay: float = Field(300.0, gt=0)
    # deprecated, ignored: patience with an in-doubt item is measured in time
    # (IN_DOUBT_MAX_SECONDS), not in lookups; kept so existing deployments still start
    lookup_max_attempts: int = Field(6, ge=1)
    # a Retry-After (or a pacing cooldown) is honoured up to this long
    retry_after_max_seconds: float = Field(300.0, gt=0)

    # --- in-doubt payments ----------------------------------------------------------------
    # an item whose payment may have been sent is looked up (capped backoff) for this long
    # after its oldest send in doubt; then it goes dead (unknown_unresolved) for a person
    in_doubt_max_seconds: float = Field(3600.0, gt=0)
    lookup_max_delay: float = Field(60.0, gt=0)
    # how long the gateway remembers an idempotency key (the protocol promises 24 h): a
    # lookup 404 proves "never applied" only while the oldest send in doubt is younger than
    # this less a safety margin of a tenth of it (see docs/processing.md)
    gateway_key_retention_seconds: float = Field(86400.0, gt=0)
    # tests only: lets IN_DOUBT_MAX_SECONDS reach past the retention, to prove that a 404
    # from a gateway that forgot the key never leads to a send. Never set it in production.
    unsafe_allow_in_doubt_past_retention: bool = False

    # --- processing -------------------------------------------------------------------------
    # items claimed (intent recorded) per statement, and outcomes written per statement
    process_chunk_size: int = Field(20, ge=1, le=1000)
    # a holder waits this long for its account's next retry before releasing the lock
    hold_wait_max_seconds: float = Field(2.0, ge=0)
    # a holder hands its account back to the queue after this long (at a chunk boundary), so
    # one account cannot pin a worker slot and the load rebalances across worker processes
    drain_max_seconds: float = Field(10.0, gt=0)

    # --- celery -------------------------------------------------------------------------
    # Celery's pool and task slots per worker process, so the plain `celery -A payment_worker
    # worker` is the fast recipe (issue 13; -P/-c on the command line still win). Threads: a
    # slot mostly waits on the gateway, and one process holds hundreds of accounts in flight.
    # gevent/eventlet are refused here: Celery monkey-patches only for -P on the command line
    # (docs/configuration.md, "Worker pool").
    worker_pool: Literal["threads", "prefork", "solo"] = "threads"
    # unset: THREADS_CONCURRENCY for threads, the CPU count for prefork (a process per slot),
    # 1 for solo
    worker_concurrency: int | None = Field(None, ge=1, le=10_000)
    # the threads pool starts all its threads once the worker is ready, instead of one per
    # task that finds none idle while messages arrive: a burst's messages are then taken
    # without a thread start each on the consumer's thread (issue 13's scenario 5)
    worker_prestart_threads: bool = True
    # a worker that runs its tasks itself (threads, solo) opens its Postgres pool
    # (DB_POOL_SIZE) and a Redis connection per 10 task slots once ready, instead of among
    # the task threads of its first burst (issue 13's scenario 4)
    worker_open_connections: bool = True
    # Celery's task events (task-sent/received/started/succeeded, as `-E` turns on): what Flower
    # and celery-exporter read. Off by default, as in Celery: with them a worker spent a third
    # more CPU per item in issue 13's scenario 5 (docs/benchmarks.md); compose turns them on
    worker_task_events: bool = False
    # messages the Redis broker transport takes per wake-up (BRPOP's own included), each
    # recorded unacked in the same script; 1: kombu's one message per round trip. Never more
    # than the free prefetch slots (worker/broker_transport.py, docs/configuration.md)
    broker_take_batch: int = Field(32, ge=1, le=1000)
    visibility_timeout: int = Field(3600, gt=0)
    task_soft_time_limit: int = Field(1500, gt=0)
    task_time_limit: int = Field(1800, gt=0)
    # issue 15: the sweeper's horizon comes from liveness (docs/processing.md, Sweeper): it
    # ticks every second, looks at accounts whose due items saw no write for
    # SWEEPER_STALE_AFTER, and re-enqueues the ones with no live lock holder
    sweeper_interval: float = Field(1.0, ge=0.1)
    sweeper_stale_after: float = Field(2.0, gt=0)
    # a repair message whose task has not started after this long is sent again
    sweeper_resend_after: float = Field(30.0, gt=0)

    # --- holder liveness (issue 15, docs/locks.md "Holder liveness") -------------------------
    # every worker process renews its liveness key every LIVENESS_INTERVAL_MS with a TTL of
    # LIVENESS_TTL_MS; a lock whose holder's key is gone is taken over at once
    liveness_ttl_ms: int = Field(3_000, gt=0)
    liveness_interval_ms: int = Field(500, ge=50)

    # --- producer -------------------------------------------------------------------------
    dedup_window_seconds: int = Field(60, gt=0)
    max_items_per_batch: int = Field(10_000, ge=1)
    # at most what the amount column (bigint) holds
    max_amount: int = Field(10**15, gt=0, le=2**63 - 1)

    # --- observability --------------------------------------------------------------------
    # 9808 is celery-exporter's default: ours must not collide with it on one host
    metrics_port: int = Field(9810, ge=0, le=65535)
    # 0 would bind a port nobody knows (Prometheus and the compose health check need it)
    exporter_port: int = Field(9809, ge=1, le=65535)
    # the exporter queries Postgres and Redis at most once per this long (scrapes share it)
    exporter_cache_seconds: float = Field(10.0, ge=0)
    log_level: str = "INFO"
    # unset (or "auto"): JSON lines when stderr is not a terminal, a console rendering on one
    log_json: bool | None = None
    # Celery's two INFO lines per message (`received`, `succeeded in`): off by default. They
    # cost about 0.2 ms of worker CPU a message (issue 13) and say what our account_drained
    # line says; failures, retries and every other line of Celery's stay
    log_task_lines: bool = False

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, v: str | None) -> str | None:
        return _check_url(v, _PG_SCHEMES, "PostgreSQL")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        return _check_url(v, _REDIS_SCHEMES, "Redis")

    @field_validator("celery_broker_url")
    @classmethod
    def _broker_url(cls, v: str | None) -> str | None:
        if v and urlsplit(v).scheme == "unix":
            raise ValueError(
                "Celery's Redis transport takes no unix:// URL: give the broker a redis:// "
                "or rediss:// URL"
            )
        return _check_url(v, _BROKER_SCHEMES, "Redis")

    @field_validator("worker_concurrency", mode="before")
    @classmethod
    def _unset_when_empty(cls, v: Any) -> Any:
        # WORKER_CONCURRENCY= (compose's ${X:-}) means unset, as for LOG_JSON and the URLs
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("gateway_url")
    @classmethod
    def _gateway_url(cls, v: str) -> str:
        checked = _check_url(v, {"http", "https"}, "HTTP")
        if checked is None:
            raise ValueError("must not be empty")
        return checked.rstrip("/")

    @field_validator("gateway_client_secret")
    @classmethod
    def _gateway_secret(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is not None and v.get_secret_value():
            return v
        url = info.data.get("gateway_url")
        if url is None:
            return v  # GATEWAY_URL itself is bad: that error is the one to show
        if not is_local_gateway(url):
            raise ValueError(
                "required: GATEWAY_URL is not the local simulator (a loopback host), and a real "
                "gateway gets no default secret"
            )
        return SecretStr(SIMULATOR_SECRET)

    @field_validator("log_json", mode="before")
    @classmethod
    def _log_json(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() in ("", "auto"):
            return None
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        if v.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {v!r}")
        return v.upper()

    @field_validator("worker_pool", mode="before")
    @classmethod
    def _worker_pool(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() in ("gevent", "eventlet"):
            raise ValueError(
                f"{v.strip()} needs `-P {v.strip().lower()}` on the celery command line "
                "(Celery monkey-patches only then); WORKER_POOL takes threads, prefork or solo"
            )
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("gateway_rate_overrides", mode="before")
    @classmethod
    def _overrides(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v.strip():
                return {}
            try:
                v = json.loads(v)
            except ValueError:
                raise ValueError(
                    "expected a JSON object of account ids and requests per second, e.g. "
                    '{"acct-1": 5}'
                ) from None
        if isinstance(v, dict):
            for key in v:
                # an account id as a batch must spell it, or the override would silently
                # never apply
                try:
                    check_identifier(key if isinstance(key, str) else "")
                except ValueError as exc:
                    raise ValueError(f"{key!r} is no account id a batch can name: {exc}") from None
        return v

    @model_validator(mode="after")
    def _limits(self) -> Settings:
        if self.celery_broker_url is None and urlsplit(self.redis_url or "").scheme == "unix":
            raise ValueError(
                "CELERY_BROKER_URL must be set (a redis:// or rediss:// URL) when REDIS_URL is "
                "a unix:// socket: the broker would be that URL, and Celery's Redis transport "
                "takes no unix:// URL"
            )
        if self.task_time_limit >= self.visibility_timeout:
            raise ValueError("TASK_TIME_LIMIT must be below VISIBILITY_TIMEOUT")
        if self.task_soft_time_limit >= self.task_time_limit:
            raise ValueError("TASK_SOFT_TIME_LIMIT must be below TASK_TIME_LIMIT")
        if self.retry_max_delay >= self.visibility_timeout:
            raise ValueError("RETRY_MAX_DELAY must be below VISIBILITY_TIMEOUT")
        if self.drain_max_seconds >= self.task_soft_time_limit:
            raise ValueError("DRAIN_MAX_SECONDS must be below TASK_SOFT_TIME_LIMIT")
        if 3 * self.lock_safety_margin_ms > self.lock_ttl_ms:
            raise ValueError(
                "LOCK_SAFETY_MARGIN_MS must be at most a third of LOCK_TTL_MS: a lock is "
                "renewed every third of its TTL and trusted until TTL - margin after the last "
                "renewal, so one late renewal must not cost it"
            )
        if self.visibility_timeout < 2 * DEAD_LETTER_RETRY_MAX_SECONDS:
            raise ValueError(
                f"VISIBILITY_TIMEOUT must be at least {2 * DEAD_LETTER_RETRY_MAX_SECONDS} s: "
                "a crash's dead letter is retried up to "
                f"{DEAD_LETTER_RETRY_MAX_SECONDS} s apart while Postgres is down, and a "
                "countdown past half the visibility timeout is delivered twice"
            )
        if 2 * self.liveness_interval_ms > self.liveness_ttl_ms - self.lock_safety_margin_ms:
            raise ValueError(
                "LIVENESS_INTERVAL_MS must be at most half of LIVENESS_TTL_MS - "
                "LOCK_SAFETY_MARGIN_MS: a holder must survive one missed heartbeat"
            )
        if self.lock_max_stall_seconds <= self.gateway_quiet_max_seconds:
            raise ValueError(
                "LOCK_MAX_STALL_SECONDS must be above GATEWAY_PACING_MAX_WAIT + 2 x "
                "(GATEWAY_CONNECT_TIMEOUT + GATEWAY_READ_TIMEOUT) + 3 "
                f"({self.gateway_quiet_max_seconds:g}s), the longest a holder that is only "
                "waiting on the gateway goes without reporting progress"
            )
        if self.db_retry_max_seconds > self.lock_max_stall_seconds / 2:
            raise ValueError(
                "DB_RETRY_MAX_SECONDS must be at most half of LOCK_MAX_STALL_SECONDS "
                f"({self.lock_max_stall_seconds / 2:g}s): a holder retrying a database error "
                "gives its account back well before it would count as stalled"
            )
        if self.db_pool_timeout > self.db_retry_max_seconds:
            raise ValueError(
                "DB_POOL_TIMEOUT must not exceed DB_RETRY_MAX_SECONDS: a wait for a free "
                "connection is one try of the drain's retry, which must fit in its bound"
            )
        if (
            self.in_doubt_max_seconds > self.key_trust_seconds / 2
            and not self.unsafe_allow_in_doubt_past_retention
        ):
            raise ValueError(
                "IN_DOUBT_MAX_SECONDS must be well below GATEWAY_KEY_RETENTION_SECONDS (at most "
                f"half of its trusted part, {self.key_trust_seconds / 2:.0f}s): an item still in "
                "doubt when the gateway forgets its key can never be resolved by a lookup"
            )
        return self

    @property
    def key_trust_seconds(self) -> float:
        """How long after a send a lookup 404 still proves "never applied": the gateway's
        key retention less a safety margin of a tenth of it (clock skew between the gateway
        and the database, the retention counted from the gateway's receipt, lookup latency)."""
        return self.gateway_key_retention_seconds * 0.9

    @property
    def gateway_quiet_max_seconds(self) -> float:
        """The longest a healthy holder goes between two progress reports while it talks to
        the gateway: one request, then the next one's token (its own refresh, or a wait for
        another worker's: the refresh lock's TTL, one request + 1 s, plus 2 s) and pacing."""
        per_call = self.gateway_connect_timeout + self.gateway_read_timeout
        return self.gateway_pacing_max_wait + 2 * per_call + 3.0

    @property
    def concurrency(self) -> int:
        """Task slots per worker process: ``WORKER_CONCURRENCY``, else the pool's default."""
        return self.concurrency_for(self.worker_pool)

    def concurrency_for(self, pool: str) -> int:
        """Task slots per process for ``pool``: ``WORKER_CONCURRENCY``, else that pool's
        default (a ``-P`` on the command line may name another pool than ``WORKER_POOL``)."""
        if self.worker_concurrency is not None:
            return self.worker_concurrency
        if pool == "threads":
            return THREADS_CONCURRENCY
        if pool == "prefork":
            return os.cpu_count() or 1
        return 1

    @property
    def home(self) -> Path:
        """The data folder of the embedded servers and local state, made absolute."""
        return self.payment_worker_home.expanduser().resolve()

    def rate_for(self, account_id: str) -> float:
        """Request quota (per second) of one account."""
        return self.gateway_rate_overrides.get(account_id, self.gateway_rate_per_second)


class SettingsError(SystemExit):
    """A bad setting: one line naming the variable, exit code 2."""


def describe_error(exc: ValidationError) -> str:
    """One line naming the offending environment variable(s)."""
    parts = []
    for err in exc.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        # a cross-field rule has no location: its message names the variables itself
        loc = err["loc"]
        if not loc:
            parts.append(msg)
            continue
        # the variable upper-cased, a key inside its value as written (an account id)
        where = str(loc[0]).upper() + "".join(f"[{json.dumps(str(k))}]" for k in loc[1:])
        parts.append(f"{where}: {msg}")
    lead = "invalid setting " if all(e["loc"] for e in exc.errors()) else "invalid settings: "
    return lead + "; ".join(parts)


def load_settings() -> Settings:
    """Settings from the environment; exits with code 2 and one clear line when a value is bad.

    Read once per process, by whoever builds the :class:`~payment_worker.runtime.Runtime`;
    everything else is handed the settings.
    """
    try:
        return Settings()
    except ValidationError as exc:
        print(f"payment-worker: {describe_error(exc)}", file=sys.stderr)
        raise SettingsError(2) from None
    except SourceError as exc:
        # a value the settings source could not decode before any validator ran
        print(f"payment-worker: invalid settings: {exc}", file=sys.stderr)
        raise SettingsError(2) from None
