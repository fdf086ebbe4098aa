"""kombu's Redis transport with one reused client per channel (``redis://`` brokers only).

kombu's Redis channel builds a new ``redis.Redis`` object for each bookkeeping call: the
unacked record of every delivered message, every ack, every publish. With redis-py 8 one
such object costs about 190 µs of CPU to build (its response-callback table is filled anew),
and in a threads worker those calls run on the single consumer thread that takes every
message, so they bound how fast accounts start (issue 13, docs/benchmarks.md). A
``redis.Redis`` over a connection pool is thread-safe for single commands, and each
pipeline is still its own object, so the channel keeps one client over its own pool.
Nothing else of kombu's transport changes: the same pool, commands, acks and restores.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis

#: kombu's "module:Class" name of the transport, for Celery's ``broker_transport``
TRANSPORT = f"{__name__}:Transport"


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's channel; its synchronous client is built once per pool, not once per call."""

    _reused_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._reused_client
        # a channel closed and used again gets a new pool (kombu's own rule): follow it
        if client is None or client.connection_pool is not self.pool:
            client = self._reused_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def transport_for(broker_url: str) -> str | None:
    """The transport to name for ``broker_url``: this one for a plain ``redis://`` URL; None
    (kombu's choice from the scheme) for any other, ``rediss://`` included, whose TLS
    defaults kombu derives from the scheme's name."""
    return TRANSPORT if broker_url.split("://", 1)[0].lower() == "redis" else None
