"""The per-process runtime: the settings and every client, built once, passed explicitly.

A :class:`Runtime` holds what the service's pieces share inside one process: the settings,
where the servers are, the SQLAlchemy engine (one bounded pool), the Redis clients and the
gateway client.
It is built once per process (at the start of each CLI command; in ``worker_init`` and
``worker_process_init`` for Celery workers) and handed to the lock, the gateway client, the
drain loop, the sweeper and the producer. Nothing else in the package keeps a per-process
cache, and importing a module starts nothing: clients connect on first use.

Building one resolves the URLs: the settings' URLs, or for an unset one the embedded
server (the zero-setup local mode, started when it is not running).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import redis
from sqlalchemy import Engine

from payment_worker.db.engine import ConnectionLimits, application_name, autocommit, make_engine
from payment_worker.domain.retry import Backoff
from payment_worker.domain.transitions import Policy
from payment_worker.gateway.client import GatewayClient
from payment_worker.locks.account_lock import AccountLock
from payment_worker.locks.giveback import GiveBack
from payment_worker.locks.liveness import Liveness
from payment_worker.locks.watchdog import Renewer, renewal_client
from payment_worker.redis_keys import RedisKeys
from payment_worker.redis_pool import sharded_client
from payment_worker.settings import Settings, load_settings


@dataclass(frozen=True, slots=True)
class ServiceUrls:
    """Where PostgreSQL (libpq form), Redis and the Celery broker are."""

    database: str
    redis: str
    broker: str

    @property
    def sqlalchemy(self) -> str:
        """The database URL in SQLAlchemy form (psycopg 3 driver)."""
        return self.database.replace("postgresql://", "postgresql+psycopg://", 1)

    @classmethod
    def resolve(cls, settings: Settings) -> ServiceUrls:
        """The settings' URLs; an unset one is served by the embedded server (started when it
        is not running). Raises :class:`~payment_worker.embedded.EmbeddedError` (one line)
        when a URL is unset and the ``embedded`` extra is not installed."""
        database, redis_url = settings.database_url, settings.redis_url
        if not database or not redis_url:
            # the local mode: only imported when a URL is unset
            from payment_worker import embedded

            missing = embedded.missing_for(database, redis_url)
            if missing:
                raise embedded.EmbeddedNotInstalled(missing)
            if not database:
                database = embedded.postgres_url(settings.home, settings.embedded_pg_os_user)
            if not redis_url:
                redis_url = embedded.redis_url(settings.home)
        database = database.replace("postgresql+psycopg://", "postgresql://", 1).replace(
            "postgres://", "postgresql://", 1
        )
        return cls(database, redis_url, settings.celery_broker_url or redis_url)


class Runtime:
    """Settings and clients of one process; thread-safe to share between worker threads."""

    def __init__(self, settings: Settings, urls: ServiceUrls | None = None) -> None:
        s = settings
        self.settings = s
        self.urls = urls if urls is not None else ServiceUrls.resolve(s)
        self.pid = os.getpid()
        # statement and lock timeouts, TCP keepalives: no connection blocks for ever
        limits = ConnectionLimits.from_settings(s)
        # one pool per process, DB_POOL_SIZE connections and never more; each named after
        # this process in pg_stat_activity
        self.engine: Engine = make_engine(
            self.urls.sqlalchemy,
            pool_size=s.db_pool_size,
            pool_timeout=s.db_pool_timeout,
            limits=limits,
            application_name=application_name(self.pid),
            pgbouncer=s.db_pgbouncer,
        )
        # the same pool in autocommit: the drain's one-statement calls and the fencing
        # upsert of every lock acquisition (one round trip each)
        self.autocommit_engine: Engine = autocommit(self.engine)
        # pools in shards: hundreds of task threads would queue on one pool's lock
        # (timeouts set here, not left to redis-py's defaults: older releases had none, and a
        # Redis that stopped answering held a thread, a give-back pass, for ever)
        self.redis: redis.Redis = sharded_client(
            self.urls.redis,
            health_check_interval=10,
            socket_timeout=5.0,
            socket_connect_timeout=5.0,
            socket_keepalive=True,
        )
        # renewals: no client-side retries, a socket timeout of at most TTL/3
        self.renewal_redis: redis.Redis = renewal_client(self.redis, s.lock_ttl_ms)
        # one thread renews every lock this process holds, one round trip per tick
        self.renewer = Renewer(self.renewal_redis)
        # and one retries the releases whose round trip failed (a Redis blip must not keep
        # an account locked for the rest of the TTL)
        self.giveback = GiveBack()
        # the producer's dedup window: a slow Redis must not stall submission (Postgres decides)
        self.dedup_redis: redis.Redis = sharded_client(
            self.urls.redis, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        self.gateway = GatewayClient(s, self.redis)
        self.keys = RedisKeys(s.redis_key_prefix)
        # this process's liveness key and heartbeat (started by the first lock, or by the
        # worker's lifecycle); its beats go through a no-retry client with a short timeout
        self.liveness_redis: redis.Redis = renewal_client(self.redis, s.liveness_ttl_ms)
        self.liveness = Liveness(
            self.liveness_redis,
            self.keys,
            ttl_ms=s.liveness_ttl_ms,
            interval_ms=s.liveness_interval_ms,
            margin_ms=s.lock_safety_margin_ms,
        )
        # set by a warm shutdown (worker/lifecycle.py): drains hand their accounts back
        self.shutting_down = threading.Event()

    @functools.cached_property
    def broker_redis(self) -> redis.Redis | None:
        """A client of the Celery broker when it is Redis (the sweeper reads the age of the
        oldest waiting message off kombu's lists), else None. Short timeouts: a sweep must
        not hang on it."""
        if not self.urls.broker.startswith(("redis://", "rediss://", "unix://")):
            return None
        return redis.Redis.from_url(self.urls.broker, socket_timeout=2, socket_connect_timeout=2)

    @property
    def fence_engine(self) -> Engine:
        """The engine of the fencing upsert: :attr:`autocommit_engine` (the one pool)."""
        return self.autocommit_engine

    @property
    def policy(self) -> Policy:
        """Retry limits and timing from the settings."""
        s = self.settings
        return Policy(
            max_attempts=s.retry_max_attempts,
            backoff=Backoff(base=s.retry_base_delay, cap=s.retry_max_delay),
            lookup_backoff=Backoff(base=s.retry_base_delay, cap=s.lookup_max_delay),
            retry_after_max=s.retry_after_max_seconds,
            in_doubt_max=s.in_doubt_max_seconds,
            key_trust=s.key_trust_seconds,
        )

    @classmethod
    def from_environment(cls) -> Runtime:
        """A runtime from the environment's settings (a bad one: one line, exit code 2)."""
        return cls(load_settings())

    def account_lock(self, account_id: str) -> AccountLock:
        """A new (not yet acquired) lock of ``account_id`` with this process's clients;
        ``with lock:`` waits for it up to ``LOCK_WAIT_TIMEOUT``."""
        s = self.settings
        return AccountLock(
            self.redis,
            account_id,
            engine=self.autocommit_engine,
            ttl_ms=s.lock_ttl_ms,
            safety_margin_ms=s.lock_safety_margin_ms,
            key_prefix=s.redis_key_prefix,
            wait_timeout=s.lock_wait_timeout,
            max_stall=s.lock_max_stall_seconds,
            liveness=self.liveness,
            renewer=self.renewer,
            giveback=self.giveback,
        )

    def close(self) -> None:
        """Close every client (end of a command, of a test, or of the process). The liveness
        key is deleted: locks this process still holds are taken over at once."""
        self.renewer.close()
        self.giveback.close()
        self.liveness.stop()
        self.gateway.close()
        for client in self._clients():
            client.close()
            client.connection_pool.disconnect()
        self.engine.dispose()  # the autocommit view shares its pool

    def abandon(self) -> None:
        """Drop the clients without touching their sockets: in a forked child, which must
        neither use nor close what it shares with its parent."""
        self.engine.dispose(close=False)
        for client in self._clients():
            client.connection_pool.reset()

    def _clients(self) -> list[redis.Redis]:
        clients = [self.redis, self.renewal_redis, self.dedup_redis, self.liveness_redis]
        broker = self.__dict__.get("broker_redis")  # only if it was ever created
        return clients + ([broker] if broker is not None else [])


# The process's runtime, for the code that cannot be handed one: Celery tasks and library
# callers of payment_worker.submit_batch. The only per-process cache of the package.
_lock = threading.Lock()
_current: Runtime | None = None


def install(runtime: Runtime) -> Runtime:
    """Make ``runtime`` this process's runtime; the one it replaces is closed."""
    global _current
    with _lock:
        old, _current = _current, runtime
    if old is not None and old is not runtime:
        _retire(old)
    return runtime


def current() -> Runtime:
    """This process's runtime, built from the environment on first use; a forked child gets
    its own (it never uses its parent's sockets)."""
    global _current
    rt = _current
    if rt is not None and rt.pid == os.getpid():
        return rt
    with _lock:
        rt = _current
        if rt is None:
            rt = _current = Runtime.from_environment()
        elif rt.pid != os.getpid():
            # forked: the parent's settings and URLs hold, its sockets are not ours
            rt.abandon()
            rt = _current = Runtime(rt.settings, rt.urls)
        return rt


def reset() -> None:
    """Close and forget this process's runtime (tests; settings changed)."""
    global _current
    with _lock:
        old, _current = _current, None
    if old is not None:
        _retire(old)


def _retire(rt: Runtime) -> None:
    if rt.pid == os.getpid():
        rt.close()
    else:
        rt.abandon()
