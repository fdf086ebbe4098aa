"""The watchdog's own Redis client (``renewal_client``): no retries, socket timeout <= TTL/3.

docs/locks.md: renewals go through their own pool built from the caller's connection
settings, with no client-side retries and a socket timeout of at most TTL/3, because the
default redis-py retries stretch one failed call over seconds (measured with redis-py 8.1:
~7 s and 11 connections for one call against a silent server, socket timeout 0.3 s). The
silent server here is a real local TCP socket that accepts and never answers.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from payment_worker.locks.watchdog import RENEW_LUA, renewal_client


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte; counts them."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self.accepted.append(conn)

    def close(self) -> None:
        # shutdown wakes the accept() blocked in the thread; close alone may not
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    srv = SilentServer()
    try:
        yield srv
    finally:
        srv.close()


def _kwargs(client: redis.Redis) -> dict[str, object]:
    return dict(client.connection_pool.connection_kwargs)


@pytest.mark.parametrize(
    ("caller_timeout", "expected"),
    [
        (None, 1.0),  # the caller has none: a hung server must not block a renewal forever
        (30.0, 1.0),  # larger than TTL/3: capped
        (1.0, 1.0),
        (0.25, 0.25),  # smaller than TTL/3: the caller's kept
    ],
)
def test_socket_timeouts_are_at_most_a_third_of_the_ttl(
    caller_timeout: float | None, expected: float
) -> None:
    caller = redis.Redis(host="127.0.0.1", port=1, socket_timeout=caller_timeout)
    rc = renewal_client(caller, ttl_ms=3000)
    kw = _kwargs(rc)
    assert kw["socket_timeout"] == expected
    assert kw["socket_connect_timeout"] == expected
    # the caller's own client is left as it was
    assert _kwargs(caller)["socket_timeout"] == caller_timeout


def test_no_client_side_retries() -> None:
    caller = redis.Redis(host="127.0.0.1", port=1, socket_timeout=1.0)
    assert caller.get_retry().get_retries() > 0  # redis-py's default does retry
    rc = renewal_client(caller, ttl_ms=3000)
    assert rc.get_retry().get_retries() == 0
    retry = _kwargs(rc)["retry"]
    assert isinstance(retry, redis.retry.Retry) and retry.get_retries() == 0


def test_keeps_the_callers_connection_settings() -> None:
    caller = redis.Redis(
        host="127.0.0.1",
        port=6390,
        db=7,
        username="u",
        password="p",
        client_name="worker-1",
        decode_responses=True,
    )
    kw = _kwargs(renewal_client(caller, ttl_ms=3000))
    for name in ("host", "port", "db", "username", "password", "client_name", "decode_responses"):
        assert kw[name] == _kwargs(caller)[name], name
    unix = redis.Redis(unix_socket_path="/tmp/pw-no-such.sock", db=3)
    rc = renewal_client(unix, ttl_ms=3000)
    assert rc.connection_pool.connection_class is redis.UnixDomainSocketConnection
    assert _kwargs(rc)["path"] == "/tmp/pw-no-such.sock"
    # its own pool: renewals never wait behind the caller's connections
    assert rc.connection_pool is not unix.connection_pool


# the Runtime builds its client from a URL: no socket timeout at all; or a caller's long one
@pytest.mark.parametrize("query", ["", "?socket_timeout=30"])
def test_renewal_against_a_silent_server_fails_within_a_third_of_the_ttl(
    silent_server: SilentServer, query: str
) -> None:
    ttl_ms = 900  # TTL/3 = 0.3 s
    caller = redis.Redis.from_url(f"redis://127.0.0.1:{silent_server.port}/0{query}")
    renew = renewal_client(caller, ttl_ms).register_script(RENEW_LUA)
    started = time.monotonic()
    with pytest.raises(redis.exceptions.TimeoutError):
        # exactly the watchdog's call (AccountLock._renew_tick)
        renew(keys=["pw:lock:{a}"], args=["token", ttl_ms])
    elapsed = time.monotonic() - started
    assert 0.25 <= elapsed < 0.6, elapsed  # one socket timeout, not redis-py's retries
    # one connection, one try: a retry would have connected again
    assert len(silent_server.accepted) == 1
