"""structlog configuration: key=value lines for people, JSON lines when LOG_JSON=true."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure_logging(level: str = "INFO", json_lines: bool = False) -> None:
    """Configure structlog and the stdlib root logger once per process."""
    global _configured
    if _configured:
        return
    _configured = True
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper()) if isinstance(level, str) else level
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
    # one line per HTTP request is noise at INFO; our own gateway logs say what matters
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # alembic announces each of its built-in plugins at INFO on every command
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger bound to ``component=name``."""
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(component=name)
    return logger
