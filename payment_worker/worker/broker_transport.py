"""kombu's Redis transport with one reused client per channel and messages taken in blocks
(``redis://`` brokers only).

kombu's Redis channel builds a new ``redis.Redis`` object for each bookkeeping call: the
unacked record of every delivered message, every ack, every publish. With redis-py 8 one
such object costs about 190 µs of CPU to build (its response-callback table is filled anew),
and in a threads worker those calls run on the single consumer thread that takes every
message, so they bound how fast accounts start (issue 13, docs/benchmarks.md). A
``redis.Redis`` over a connection pool is thread-safe for single commands, and each
pipeline is still its own object, so the channel keeps one client over its own pool.

kombu also spends two round trips on every message it delivers: its ``BRPOP``, then the
unacked record (a pipeline). On that same consumer thread, among hundreds of task threads,
each round trip waited about 4 ms for the GIL and Redis, so a worker took one message every
5 to 6 ms and 400 accounts needed over a second to start (issue 13). The channel here keeps
kombu's ``BRPOP`` as the wake-up and, in one script (``broker_take.lua``), records that
message as kombu would and pops more, up to ``take_batch`` in all and never past the free
prefetch slots, recording each in the same step: a popped message is never out of the
queue without its unacked record (the ``BRPOP``'s own keeps kombu's short window until the
script has run). The records are kombu's (the message kept byte for byte, the two names
JSON-encoded by Redis's cjson: the same values decoded), so acks, rejects,
``restore_unacked`` and the visibility-timeout restore are kombu's.
A message kombu cannot make a message of (its ``Message`` raises: a body it cannot decode,
headers that are no object, no tag or delivery info to record it by) is dropped with an
error line and its record removed;
kombu's own transport lost it too, and the worker with it, and put back at the head of the
queue it would end every worker that took it in turn.
Everything else of kombu's transport is unchanged.
"""

from __future__ import annotations

from queue import Empty
from time import time
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from payment_worker import lua
from payment_worker.errors import PaymentWorkerError

#: kombu's "module:Class" name of the transport, for Celery's ``broker_transport``
TRANSPORT = f"{__name__}:Transport"

#: most messages one wake-up takes, BRPOP's included (transport option ``take_batch``);
#: 1 is kombu's one message per round trip
DEFAULT_TAKE_BATCH = 32

_TAKE = lua.load("broker_take")


class Unreadable(PaymentWorkerError):
    """kombu could not make a message of a taken payload (its ``Message`` raised)."""


class Message(virtual.Message):  # type: ignore[misc]
    """kombu's message; a payload it cannot read raises :class:`Unreadable`, so a failed
    delivery tells that apart from any other failure (a Redis error in a reject)."""

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        try:
            super().__init__(payload, channel=channel, **kwargs)
        except Exception as exc:
            raise Unreadable(f"{type(exc).__name__}: {exc}") from exc
        # what kombu's QoS records it by: without them its record raised after the message
        # was out of the queue (kombu's own transport too), ending the consumer
        info = self.delivery_info
        if not (
            isinstance(self.delivery_tag, str)
            and isinstance(info, dict)
            and {"exchange", "routing_key"} <= info.keys()
        ):
            raise Unreadable("no delivery tag or delivery info kombu can record it by")


class QoS(kombu_redis.QoS):  # type: ignore[misc]
    """kombu's ack emulation; a message the take script already recorded is not written again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: delivery tags recorded in Redis by the take script, not yet delivered
        self.prerecorded: set[str] = set()

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.prerecorded:
            self.prerecorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)  # the process's own bookkeeping
        else:
            super().append(message, delivery_tag)


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's channel; its synchronous client is built once per pool, not once per call,
    and each ``BRPOP`` reply brings up to ``take_batch`` messages in one more round trip."""

    QoS = QoS
    Message = Message
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "take_batch")
    take_batch = DEFAULT_TAKE_BATCH

    _reused_client: Any = None
    _take_script: Any = None
    #: consumer tags of this channel's no-ack consumers (blocks are off while there are any)
    _no_ack_tags: frozenset[str] = frozenset()

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._reused_client
        # a channel closed and used again gets a new pool (kombu's own rule): follow it
        if client is None or client.connection_pool is not self.pool:
            client = self._reused_client = super()._create_client()
        return client

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        # a no-ack consumer never acks: a record written for its message would only be
        # restored, a second delivery, after the visibility timeout
        if no_ack:
            self._no_ack_tags = self._no_ack_tags | {consumer_tag}
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def _basic_cancel(self, consumer_tag: str) -> Any:
        # kombu's cancel, run once no read is in progress (its own rule): from then on the
        # consumer's messages are no longer taken, so blocks may come back with the last one
        self._no_ack_tags = self._no_ack_tags - {consumer_tag}
        return super()._basic_cancel(consumer_tag)

    def _brpop_read(self, **options: Any) -> bool:
        # (without ack emulation kombu's QoS keeps no records: nothing would restore a block)
        if (
            self.take_batch <= 1
            or self.global_keyprefix
            or self._no_ack_tags
            or not self.ack_emulation
        ):
            return bool(super()._brpop_read(**options))
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # kombu's rule: disconnect, so the next iteration reconnects
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise Empty()
            key, item = dest__item
            self._deliver_taken(bytes_to_str(key), bytes_to_str(item))
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _deliver_taken(self, key: str, item: str) -> None:
        """Record BRPOP's message and take more in one script, then deliver them in order."""
        limit = self.qos.can_consume_max_estimate()  # None: no prefetch limit
        more = self.take_batch - 1 if limit is None else min(self.take_batch, limit) - 1
        # kombu's BRPOP order: its round robin over the queues (each delivery below rotates
        # the queue it came from to the end), by priority step
        queues = self._queue_cycle.consume(len(self.active_queues))
        keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        with self.conn_or_acquire() as client:
            if self._take_script is None:
                self._take_script = client.register_script(_TAKE)
            reply = self._take_script(
                keys=[self.unacked_key, self.unacked_index_key, *keys],
                args=[time(), max(more, 0), item],
                client=client,
            )
        # (queue key, message, recorded by the script), BRPOP's message first
        entries: list[tuple[str, str | bytes, Any]] = [(key, item, reply[0])]
        entries += [
            (keys[int(reply[i]) - 1], reply[i + 2], reply[i + 1]) for i in range(1, len(reply), 3)
        ]
        taken: list[tuple[str, Any, str | None]] = []  # (queue key, message, its tag)
        for key_name, raw, recorded in entries:
            # the tag the script recorded the message under, as Redis holds it (0: none)
            rtag = recorded if isinstance(recorded, bytes) else None
            try:
                message = loads(bytes_to_str(raw))
                if not isinstance(message, dict):
                    raise ValueError("not a JSON object")
            except Exception:  # (kombu's decoders raise more than ValueError; no I/O here)
                # not a kombu message (pushed by hand?), dropped with a line, and the rest of
                # the block delivered. Raising here left the block's recorded messages out of
                # their queue until the visibility timeout (an hour). Usually never recorded
                # (the script reads no tag in it); one that Redis's JSON decoder read and
                # Python's does not leaves its record too, which kombu's visibility restore
                # would meet on every pass, holding back the records after it
                kombu_redis.logger.error(
                    "dropped a message that is not a kombu message from %s: %.200r",
                    key_name,
                    raw,
                    exc_info=True,
                )
                if rtag is not None:
                    self._drop_record(rtag)
                continue
            tag = _tag(message)
            if rtag is not None:
                if tag is not None and tag.encode("utf-8", "surrogatepass") == rtag:
                    self.qos.prerecorded.add(tag)
                else:
                    # Redis's decoder read another tag than Python's (bytes that are no
                    # UTF-8): its record would be restored after the visibility timeout, a
                    # second delivery. Delivered unrecorded instead: kombu records it
                    self._drop_record(rtag)
            taken.append((key_name, message, tag))
        delivered = 0
        try:
            for key_name, message, tag in taken:
                dest = key_name.rsplit(self.sep, 1)[0]
                self._queue_cycle.rotate(dest)
                try:
                    self.connection._deliver(message, dest)
                except Unreadable:
                    # kombu could not make a message of it (before any QoS took it over):
                    # put back, it would end every worker that takes it, one after another
                    kombu_redis.logger.error(
                        "dropped a message kombu cannot read from %s (tag %s)",
                        key_name,
                        tag,
                        exc_info=True,
                    )
                    if tag is not None and tag in self.qos.prerecorded:
                        self.qos.prerecorded.discard(tag)
                        self._drop_record(tag)
                    delivered += 1
                    continue
                # taken over (QoS.append) or, with no consumer for its queue, rejected by
                # kombu through its first channel's QoS, maybe not this one: not ours to keep
                self.qos.prerecorded.discard(tag)
                delivered += 1
        finally:
            if delivered < len(taken):
                # a delivery raised (a shutdown, a lost connection): the messages not
                # handed over go back now, not after the visibility timeout
                self._restore_taken([t for _k, _m, t in taken[delivered:]])

    def _drop_record(self, tag: str | bytes) -> None:
        """Remove the unacked record of a dropped message (kombu's own removal, as an ack)."""
        try:
            self.qos._remove_from_indices(tag).execute()
        except Exception:  # the broker is gone: the visibility restore meets it later
            kombu_redis.logger.warning("could not remove the record of %s", tag, exc_info=True)

    def _restore_taken(self, tags: list[str | None]) -> None:
        """Put back, at the head of their queues and in their order, the messages of
        ``tags`` whose record the take script wrote and that kombu never took over (those
        it did are in its own bookkeeping, restored by its rules)."""
        for tag in reversed(tags):
            if tag is None or tag not in self.qos.prerecorded:
                continue
            self.qos.prerecorded.discard(tag)
            try:
                self.qos.restore_by_tag(tag)
            except Exception:  # the broker is gone: the visibility timeout restores it
                kombu_redis.logger.warning("could not restore message %s", tag, exc_info=True)


def _tag(message: Any) -> str | None:
    """A decoded message's delivery tag, if it has a readable one."""
    props = message.get("properties") if isinstance(message, dict) else None
    tag = props.get("delivery_tag") if isinstance(props, dict) else None
    return tag if isinstance(tag, str) else None


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def transport_for(broker_url: str) -> str | None:
    """The transport to name for ``broker_url``: this one for a plain ``redis://`` URL; None
    (kombu's choice from the scheme) for any other, ``rediss://`` included, whose TLS
    defaults kombu derives from the scheme's name."""
    return TRANSPORT if broker_url.split("://", 1)[0].lower() == "redis" else None
