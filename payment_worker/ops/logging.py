"""One log stream per process: structlog's events and the standard library's records (Celery,
kombu, SQLAlchemy, alembic, aiohttp...) rendered by the same processors, on stderr.

JSON lines (one object per line, with ``event``, ``level``, ``timestamp``, ``logger``) when
stderr is not a terminal or ``LOG_JSON=true``; a readable console rendering on a terminal or
with ``LOG_JSON=false``. Every line goes through :class:`Redactor` last: passwords in URLs,
the known secrets and account numbers in error texts are masked (docs/logging.md).

Every entry point configures it once, from the settings (:func:`configure_from_settings`):
each ``payment-worker`` command, ``dlq``, and Celery's worker and beat through Celery's
``setup_logging`` signal (``payment_worker.worker.log_context``), so Celery installs no
handler of its own. Context (task id, batch id, account id; per item the transaction id,
attempt and fence token) comes from :mod:`structlog.contextvars`, merged into every line,
Celery's own included.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from payment_worker.ops.redaction import SecretScrubber, mask_account_numbers, mask_urls

if TYPE_CHECKING:
    from payment_worker.settings import Settings

# fields whose text may come from outside (a gateway body, an exception): account numbers
# in them are masked. Ids (batch_id, transaction_id, idempotency keys) are never touched.
ERROR_FIELDS = frozenset(
    {"event", "error", "errors", "body", "detail", "last_error", "exception", "message"}
)

# this process's configuration: set once by configure_logging
_redactor: Redactor | None = None
_json = False


class Redactor:
    """The last processor before rendering: masks URL passwords and the known secrets in
    every string field, and account-number-like runs in :data:`ERROR_FIELDS`."""

    def __init__(self, scrub: SecretScrubber) -> None:
        self._scrub = scrub

    def add_secrets(self, secrets: Iterable[str | None]) -> None:
        """Scrub these values too (a later configuration call that knows more secrets)."""
        self._scrub = SecretScrubber([*self._scrub.secrets, *secrets])

    def __call__(self, _: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        scrub = self._scrub
        for key, value in event_dict.items():
            if not isinstance(value, str):
                continue
            new = value
            if "@" in new or "assword=" in new:
                new = mask_urls(new)
            if key in ERROR_FIELDS:
                new = mask_account_numbers(new)
            if scrub:
                new = scrub(new)
            if new is not value:
                event_dict[key] = new
        return event_dict


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record (a test's capture, a
    redirect made after configuration), never to a stream closed since."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def stderr_is_tty() -> bool:
    """True when stderr is a terminal (a person is reading)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def configure_logging(
    level: str = "INFO", json_lines: bool | None = None, secrets: Iterable[str | None] = ()
) -> None:
    """Configure structlog and the standard library's root logger, once per process.

    ``json_lines`` None: JSON unless stderr is a terminal. ``secrets``: values never to be
    printed (see :class:`~payment_worker.ops.redaction.SecretScrubber`).
    """
    global _redactor, _json
    if _redactor is not None:
        # configured already (e.g. at worker_init, then by Celery's setup_logging): the
        # first level and format hold, secrets only add up
        _redactor.add_secrets(secrets)
        return
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    tty = stderr_is_tty()
    as_json = (not tty) if json_lines is None else json_lines
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor = (
        structlog.processors.JSONRenderer(default=str)
        if as_json
        else structlog.dev.ConsoleRenderer(colors=tty)
    )
    redactor = _redactor = Redactor(SecretScrubber(secrets))
    _json = as_json
    tail: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if as_json:
        # the console renderer formats tracebacks itself; JSON needs them as a string field
        tail.append(structlog.processors.format_exc_info)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[*tail, redactor, renderer],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        # calls below the level return at once: a debug line on the hot path costs a call
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    logging.captureWarnings(True)
    # what no line of ours shows, not gathered for every record (the logging HOWTO's
    # "Optimization"): the caller's frame, thread, process and multiprocessing names.
    # structlog's formatter copies each record, so each line paid for it twice (about a
    # quarter of a line's CPU, measured)
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # one line per HTTP request is noise at INFO; our own gateway logs say what matters
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # alembic announces each of its built-in plugins at INFO on every command
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def json_lines() -> bool:
    """True when this process writes JSON lines (after :func:`configure_logging`)."""
    return _json


def secrets_of(settings: Settings) -> list[str | None]:
    """The values the logs must never show: the gateway secret and the URLs' passwords."""
    from payment_worker.ops.redaction import url_password

    secret = settings.gateway_client_secret
    return [
        secret.get_secret_value() if secret is not None else None,
        *(
            url_password(u)
            for u in (settings.database_url, settings.redis_url, settings.celery_broker_url)
        ),
    ]


def configure_from_settings(settings: Settings) -> None:
    """:func:`configure_logging` with ``LOG_LEVEL``, ``LOG_JSON`` and the settings' secrets."""
    configure_logging(settings.log_level, settings.log_json, secrets_of(settings))


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger bound to ``component=name``."""
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(component=name)
    return logger
