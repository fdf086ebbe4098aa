"""Exceptions shared across layers."""

from __future__ import annotations


class PaymentWorkerError(Exception):
    """Base class of the service's own errors."""


class LockLost(PaymentWorkerError):
    """The account lock is no longer ours: stop before the next side effect."""


class FencedOut(PaymentWorkerError):
    """A state write carried a fencing token older than the account's current one."""


class LockNotAcquired(PaymentWorkerError):
    """The account lock is held by someone else."""
