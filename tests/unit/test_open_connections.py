"""open_connections (worker/lifecycle.py) when a server does not answer: the worker starts
all the same, and its tasks open the connections they need later."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import structlog

from payment_worker.redis_pool import sharded_client
from payment_worker.worker.lifecycle import open_connections


def test_a_server_that_refuses_leaves_the_worker_starting() -> None:
    # nothing listens on port 1: the connect is refused at once
    rt: Any = SimpleNamespace(redis=sharded_client("redis://127.0.0.1:1/0"), engine=None)
    with structlog.testing.capture_logs() as logs:
        assert open_connections(rt, 100) is None
    [warning] = [e for e in logs if e["event"] == "connections_not_opened"]
    assert warning["log_level"] == "warning" and "ConnectionError" in warning["error"]
