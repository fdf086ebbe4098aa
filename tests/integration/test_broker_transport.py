"""kombu's Redis transport with a reused client (payment_worker.worker.broker_transport)
against the real broker Redis: messages published, delivered, acked and restored as with
kombu's own; one client per channel pool, not one per call; a closed channel's successor
gets a client of its own pool; messages taken in blocks, each recorded (in kombu's format)
before it is handed over, the prefetch limit kept, a block's rest put back when a delivery
raises, no-ack consumers left to kombu (blocks back once they are cancelled), and a block's
message whose queue lost its consumer requeued by kombu and forgotten by the channel."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.utils.json import loads

from payment_worker.worker.broker_transport import TRANSPORT, Channel
from payment_worker.worker.celery_app import app
from tests.conftest import PwEnv

_Q = Queue("pw-transport-test", Exchange("pw-transport-test"), routing_key="pw-transport-test")


def _unacked(url: str) -> int:
    return int(redis.Redis.from_url(url).hlen("unacked"))


def test_the_workers_celery_uses_it_for_a_redis_broker(pw_env: PwEnv) -> None:
    with app.connection_for_write() as conn:
        assert isinstance(conn.default_channel, Channel)
        # BROKER_TAKE_BATCH reaches the channel through Celery's transport options
        assert conn.default_channel.take_batch == pw_env.settings.broker_take_batch == 32


def test_publish_consume_ack_and_restore_with_one_client(pw_env: PwEnv) -> None:
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT) as conn:
        channel = conn.channel()
        assert isinstance(channel, Channel)
        _Q(channel).declare()
        producer = Producer(channel, exchange=_Q.exchange, routing_key=_Q.routing_key)
        # every thread publishes through the same client object, all delivered
        threads = [
            threading.Thread(
                target=lambda n=n: [producer.publish({"n": n, "i": i}) for i in range(25)]
            )
            for n in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        client = channel._create_client()
        assert channel._create_client() is client
        assert client.connection_pool is channel.pool

        got: list[dict[str, int]] = []
        held = []

        def on_message(body: dict[str, int], message: object) -> None:
            got.append(body)
            if len(got) <= 95:
                message.ack()  # type: ignore[attr-defined]
            else:
                held.append(message)

        consumer_channel = conn.channel()
        with Consumer(consumer_channel, [_Q], callbacks=[on_message]):
            while len(got) < 100:
                conn.drain_events(timeout=5)
        assert sorted((b["n"], b["i"]) for b in got) == [
            (n, i) for n in range(4) for i in range(25)
        ]
        # the unacked bookkeeping is kombu's: 5 still recorded, then restored on close
        assert _unacked(url) == 5
        consumer_channel.close()
    assert _unacked(url) == 0
    assert redis.Redis.from_url(url).llen("pw-transport-test") == 5


def test_a_reopened_pool_gets_its_own_client(pw_env: PwEnv) -> None:
    with Connection(pw_env.broker_url, transport=TRANSPORT) as conn:
        channel = conn.channel()
        first = channel._create_client()
        channel._disconnect_pools()  # what a channel's close does to its pools
        second = channel._create_client()
        assert second is not first
        assert second.connection_pool is channel.pool
        assert second.ping()


# --- messages taken in blocks (take_batch) ------------------------------------------------


def _publish(conn: Connection, n: int) -> None:
    channel = conn.channel()
    _Q(channel).declare()
    producer = Producer(channel, exchange=_Q.exchange, routing_key=_Q.routing_key)
    for i in range(n):
        producer.publish({"i": i})
    channel.close()


def _queued(url: str) -> list[int]:
    """The bodies' numbers in the order the next pops would take them (BRPOP pops the tail)."""
    raw = redis.Redis.from_url(url).lrange("pw-transport-test", 0, -1)
    return [loads(_body(r))["i"] for r in reversed(raw)]


def _body(raw: bytes) -> str:
    payload = loads(raw)
    body: str = payload["body"]
    if payload["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body).decode()
    return body


def _acking(got: list[int]) -> Callable[[dict[str, int], Any], None]:
    """A consumer callback that notes each body's number in ``got`` and acks the message."""

    def on_message(body: dict[str, int], message: Any) -> None:
        got.append(body["i"])
        message.ack()

    return on_message


def _drain_rounds(conn: Connection, got: list[int]) -> list[int]:
    """Messages delivered per ``drain_events`` call (one BRPOP reply each), until none is left."""
    rounds = []
    while True:
        before = len(got)
        try:
            conn.drain_events(timeout=0.5)
        except TimeoutError:
            return rounds
        rounds.append(len(got) - before)


def test_one_wake_up_takes_a_block_each_recorded_before_it_is_handed_over(
    pw_env: PwEnv,
) -> None:
    url = pw_env.broker_url
    r = redis.Redis.from_url(url)
    with Connection(url, transport=TRANSPORT, transport_options={"take_batch": 8}) as conn:
        _publish(conn, 20)
        got: list[int] = []
        recorded_before: list[bool] = []

        def on_message(body: dict[str, int], message: object) -> None:
            tag = message.delivery_tag  # type: ignore[attr-defined]
            # kombu's own record, in its own format, before the task sees the message
            record = r.hget("unacked", tag)
            recorded_before.append(
                record is not None
                and loads(record)[1:] == ["pw-transport-test", "pw-transport-test"]
                and loads(record)[0]["properties"]["delivery_tag"] == tag
                and r.zscore("unacked_index", tag) is not None
            )
            got.append(body["i"])
            message.ack()  # type: ignore[attr-defined]

        with Consumer(conn.channel(), [_Q], callbacks=[on_message]):
            rounds = _drain_rounds(conn, got)
    assert rounds == [8, 8, 4]
    assert got == list(range(20))  # in the queue's order
    assert all(recorded_before)
    assert _unacked(url) == 0 and r.zcard("unacked_index") == 0


def test_take_batch_1_is_kombus_one_message_per_wake_up(pw_env: PwEnv) -> None:
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT, transport_options={"take_batch": 1}) as conn:
        _publish(conn, 5)
        got: list[int] = []
        with Consumer(conn.channel(), [_Q], callbacks=[_acking(got)]):
            assert _drain_rounds(conn, got) == [1, 1, 1, 1, 1]
    assert got == list(range(5))


def test_a_block_never_exceeds_the_free_prefetch_slots(pw_env: PwEnv) -> None:
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT) as conn:  # take_batch 32, the default
        _publish(conn, 20)
        held: list[object] = []
        got: list[int] = []

        def on_message(body: dict[str, int], message: object) -> None:
            got.append(body["i"])
            held.append(message)

        with Consumer(conn.channel(), [_Q], callbacks=[on_message], prefetch_count=5):
            assert _drain_rounds(conn, got) == [5]
            assert _unacked(url) == 5 and len(_queued(url)) == 15
            for m in held[:3]:
                m.ack()  # type: ignore[attr-defined]
            assert _drain_rounds(conn, got) == [3]
    assert got == list(range(8))


def test_a_delivery_that_raises_puts_the_rest_of_its_block_back_in_order(
    pw_env: PwEnv,
) -> None:
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT, transport_options={"take_batch": 10}) as conn:
        _publish(conn, 12)
        got: list[int] = []

        def on_message(body: dict[str, int], message: object) -> None:
            got.append(body["i"])
            if body["i"] == 2:
                raise KeyboardInterrupt  # what a shutdown signal does mid-block

        channel = conn.channel()
        with Consumer(channel, [_Q], callbacks=[on_message]):
            with pytest.raises(KeyboardInterrupt):
                conn.drain_events(timeout=2)
            # 3 handed over (kombu's bookkeeping has them); 7 put back at the head, in order,
            # ahead of the 2 never taken
            assert got == [0, 1, 2]
            assert _queued(url) == [3, 4, 5, 6, 7, 8, 9, 10, 11]
            assert _unacked(url) == 3
            channel.close()  # kombu restores its 3
    assert sorted(_queued(url)) == list(range(12))
    assert _unacked(url) == 0


def test_a_message_that_is_not_a_kombu_message_is_dropped_and_the_rest_of_its_block_delivered(
    pw_env: PwEnv,
) -> None:
    """Someone pushed lines by hand into the queue. Before, decoding it raised after the
    script had recorded the block's other messages: they were out of their queue, delivered
    to no one, until the visibility timeout (an hour). A review found it."""
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT, transport_options={"take_batch": 10}) as conn:
        _publish(conn, 3)
        r = redis.Redis.from_url(url)
        # popped 4th to 6th of the block: not JSON, not UTF-8, JSON but not a message
        r.lpush("pw-transport-test", b"not json", b"\xff\xfe", b"123")
        _publish(conn, 2)
        got: list[int] = []
        channel = conn.channel()
        with Consumer(channel, [_Q], callbacks=[_acking(got)]):
            conn.drain_events(timeout=2)
            assert got == [0, 1, 2, 0, 1]  # the whole block, in order, in one wake-up
        channel.close()
    assert _queued(url) == [] and _unacked(url) == 0


def _publish_spoilt(
    conn: Connection, url: str, i: int, change: Callable[[dict[str, Any]], None]
) -> None:
    """Publish body ``i``, then change its decoded form in place (the queue's head): a
    message with its own delivery tag, which the take script records."""
    _publish_one(conn, i)
    r = redis.Redis.from_url(url)
    raw = r.lpop("pw-transport-test")
    assert raw is not None
    payload = loads(raw)
    change(payload)
    r.lpush("pw-transport-test", json.dumps(payload))


def _publish_one(conn: Connection, i: int) -> None:
    channel = conn.channel()
    _Q(channel).declare()
    Producer(channel, exchange=_Q.exchange, routing_key=_Q.routing_key).publish({"i": i})
    channel.close()


def test_a_message_kombu_cannot_read_is_dropped_with_its_record_and_ends_no_worker(
    pw_env: PwEnv,
) -> None:
    """Recorded messages kombu's ``Message`` cannot be made of (a base64 body that is not,
    headers that are no object), and ones whose record Redis's JSON decoder wrote and
    Python's cannot read (an unknown ``__type__``, a decimal that is none). Before, the
    first raised out of the consumer, put back at the head of its queue: every worker that
    took it ended; the others' records were left for kombu's visibility restore, which
    raised on them at every pass (a review found both)."""
    url = pw_env.broker_url
    r = redis.Redis.from_url(url)
    with Connection(url, transport=TRANSPORT, transport_options={"take_batch": 10}) as conn:
        _publish_one(conn, 0)
        _publish_spoilt(conn, url, 1, lambda m: m.update(body="abc"))  # base64, unpadded
        _publish_spoilt(conn, url, 2, lambda m: m.update(headers=[1]))
        _publish_one(conn, 3)
        _publish_spoilt(conn, url, 4, lambda m: m.update(headers={"__type__": "?", "__value__": 1}))
        # kombu's own decoders raise more than ValueError (here decimal.InvalidOperation)
        bad_decimal = {"__type__": "decimal", "__value__": "x"}
        _publish_spoilt(conn, url, 6, lambda m: m.update(headers=bad_decimal))
        # no delivery info: never recorded, and kombu's record of it raised with the message
        # already out of the queue (kombu's own transport too)
        _publish_spoilt(conn, url, 7, lambda m: m["properties"].pop("delivery_info"))
        _publish_one(conn, 5)
        got: list[int] = []
        channel = conn.channel()
        with Consumer(channel, [_Q], callbacks=[_acking(got)]):
            conn.drain_events(timeout=2)  # raises nothing
            assert got == [0, 3, 5]  # those that can be read, in order, in one wake-up
        channel.close()
    assert _queued(url) == [] and _unacked(url) == 0 and r.zcard("unacked_index") == 0


def test_records_of_a_block_are_restored_by_kombus_visibility_timeout(pw_env: PwEnv) -> None:
    url = pw_env.broker_url
    opts = {"take_batch": 10, "visibility_timeout": 1}
    with Connection(url, transport=TRANSPORT, transport_options=opts) as conn:
        _publish(conn, 6)
        got: list[int] = []
        channel = conn.channel()
        consumer = Consumer(channel, [_Q], callbacks=[lambda body, message: got.append(body["i"])])
        consumer.consume()
        assert _drain_rounds(conn, got) == [6]
        assert _unacked(url) == 6 and _queued(url) == []
        time.sleep(1.2)
        channel.qos.restore_visible(num=100, interval=1)  # what kombu's poller runs
        assert sorted(_queued(url)) == list(range(6))
        assert _unacked(url) == 0


def test_a_no_ack_consumer_is_left_to_kombu(pw_env: PwEnv) -> None:
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT) as conn:
        _publish(conn, 4)
        got: list[int] = []
        with Consumer(
            conn.channel(), [_Q], callbacks=[lambda b, m: got.append(b["i"])], no_ack=True
        ):
            assert _drain_rounds(conn, got) == [1, 1, 1, 1]
        assert _unacked(url) == 0  # nothing recorded that no ack would ever remove
    assert got == list(range(4))


def test_blocks_come_back_once_the_no_ack_consumer_is_cancelled(pw_env: PwEnv) -> None:
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT, transport_options={"take_batch": 8}) as conn:
        _publish(conn, 2)
        got: list[int] = []
        channel = conn.channel()
        no_ack = Consumer(channel, [_Q], callbacks=[lambda b, m: got.append(b["i"])], no_ack=True)
        no_ack.consume()
        assert _drain_rounds(conn, got) == [1, 1]
        no_ack.cancel()
        _publish(conn, 10)
        with Consumer(channel, [_Q], callbacks=[_acking(got)]):
            assert _drain_rounds(conn, got) == [8, 2]
    assert got == [0, 1, *range(10)]
    assert _unacked(url) == 0


def test_a_taken_message_whose_queue_lost_its_consumer_goes_back_and_is_forgotten(
    pw_env: PwEnv,
) -> None:
    url = pw_env.broker_url
    with Connection(url, transport=TRANSPORT, transport_options={"take_batch": 8}) as conn:
        _publish(conn, 4)
        got: list[int] = []
        channel = conn.channel()

        def on_message(body: dict[str, int], message: Any) -> None:
            got.append(body["i"])
            message.ack()
            # the queue's consumer goes away mid-block (a cancel racing the read): kombu
            # rejects the block's rest, requeued, as it would a message nobody consumes
            conn.transport._callbacks.pop(_Q.name, None)

        with Consumer(channel, [_Q], callbacks=[on_message]):
            conn.drain_events(timeout=2)
            assert got == [0]
            # back at the head, in order, their records gone, and nothing left to remember
            assert _queued(url) == [1, 2, 3]
            assert _unacked(url) == 0
            assert channel.qos.prerecorded == set()
