"""The process's limit of open files, raised to what thousands of accounts in flight need.

Every account in flight holds sockets: its request's connection to the gateway and, while a
command runs, a Redis connection (:mod:`payment_worker.redis_pool`). A threads worker at the
default concurrency opens about 1,000 files at 1 s gateway latency, past the soft limit of
1,024 that many Linux systems give a process, and a socket it cannot open fails a payment
call (``EMFILE``). The soft limit is a per-process setting any process may raise up to its hard
limit, so the worker and the simulator raise it at start; a hard limit below the need is
logged, not guessed around.
"""

from __future__ import annotations

import contextlib
import resource

# files a task slot may hold at once (gateway connection, Redis connections), and the rest
FILES_PER_SLOT = 3
FILES_BASE = 200


def files_needed(slots: int) -> int:
    """About how many open files a worker process with ``slots`` task slots may need."""
    return FILES_BASE + FILES_PER_SLOT * slots


def raise_open_files_limit() -> int:
    """Raise the soft limit of open files to the hard one; returns the soft limit now in
    force (``resource.RLIM_INFINITY`` counts as unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
