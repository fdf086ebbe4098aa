"""Retry timing: exponential backoff with full jitter, a cap, and Retry-After as a floor."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Full-jitter exponential backoff (the AWS architecture blog's "full jitter").

    ``delay(n)`` for the n-th retry (n >= 1) is uniform in [0, min(cap, base * 2**(n-1))]:
    retries of many items spread out instead of arriving together.
    """

    base: float
    cap: float

    def ceiling(self, attempt: int) -> float:
        """The upper bound of the n-th delay."""
        exp = min(max(attempt - 1, 0), 62)
        return float(min(self.cap, self.base * (2**exp)))

    def delay(self, attempt: int, *, floor: float = 0.0, rng: random.Random | None = None) -> float:
        """Seconds to wait before the n-th retry; never below ``floor`` (e.g. Retry-After)."""
        r = rng or random
        jittered = r.uniform(0.0, self.ceiling(attempt))
        # Retry-After is a minimum, not a suggestion; the cap never shortens it
        return max(jittered, floor)
