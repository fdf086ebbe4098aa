"""Where the service's PostgreSQL, Redis and broker are: the settings' URLs or embedded servers.

With ``DATABASE_URL`` / ``REDIS_URL`` set, the embedded servers are never started.
"""

from __future__ import annotations

import functools

from payment_worker.settings import Settings, get_settings


def _settings(settings: Settings | None) -> Settings:
    return settings if settings is not None else get_settings()


@functools.lru_cache(maxsize=8)
def _embedded_pg(home: str, os_user: str) -> str:
    from pathlib import Path

    from payment_worker import embedded

    return embedded.postgres_url(Path(home), os_user)


@functools.lru_cache(maxsize=8)
def _embedded_redis(home: str) -> str:
    from pathlib import Path

    from payment_worker import embedded

    return embedded.redis_url(Path(home))


def require_servers(settings: Settings | None = None) -> None:
    """Raise :class:`EmbeddedNotInstalled` (one line naming every unset URL) when a URL is
    unset and the embedded extra that would stand in for it is not installed."""
    from payment_worker.embedded import EmbeddedNotInstalled, missing_for

    s = _settings(settings)
    missing = missing_for(s.database_url, s.redis_url)
    if missing:
        raise EmbeddedNotInstalled(missing)


def database_url(settings: Settings | None = None) -> str:
    """A libpq-style URL (``postgresql://``) of the service's database."""
    s = _settings(settings)
    url = s.database_url or _embedded_pg(str(s.home), s.embedded_pg_os_user)
    return url.replace("postgresql+psycopg://", "postgresql://", 1).replace(
        "postgres://", "postgresql://", 1
    )


def sqlalchemy_url(settings: Settings | None = None) -> str:
    """The database URL in SQLAlchemy form (psycopg 3 driver)."""
    return database_url(settings).replace("postgresql://", "postgresql+psycopg://", 1)


def redis_url(settings: Settings | None = None) -> str:
    """URL of the Redis that holds locks, tokens, pacing and dedup keys."""
    s = _settings(settings)
    return s.redis_url or _embedded_redis(str(s.home))


def broker_url(settings: Settings | None = None) -> str:
    """The Celery broker URL; defaults to ``REDIS_URL``."""
    s = _settings(settings)
    return s.celery_broker_url or redis_url(s)
