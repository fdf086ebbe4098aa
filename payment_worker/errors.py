"""Exceptions shared across layers, and the base of every exception the package defines.

Every error class of ``payment_worker`` derives from :class:`PaymentWorkerError`; one that
callers also catch as a builtin (``ValueError``) derives from both. The one exception is
``settings.SettingsError``: a ``SystemExit`` on purpose, so that a bad setting ends any
process with exit code 2 and one line, and no ``except Exception`` (a task, a retry loop)
can swallow it.
"""

from __future__ import annotations


class PaymentWorkerError(Exception):
    """Base class of the service's own errors."""


class LockLost(PaymentWorkerError):
    """The account lock is no longer ours: stop before the next side effect."""


class FencedOut(PaymentWorkerError):
    """A state write carried a fencing token older than the account's current one."""


class LockNotAcquired(PaymentWorkerError):
    """The account lock is held by someone else."""


class DatabaseUnavailable(PaymentWorkerError):
    """Transient database errors lasted past ``DB_RETRY_MAX_SECONDS``: the holder gives its
    account back (released, re-enqueued) instead of failing its task."""
