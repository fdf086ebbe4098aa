"""kombu's Redis transport with a reused client (payment_worker.worker.broker_transport)
against the real broker Redis: messages published, delivered, acked and restored as with
kombu's own; one client per channel pool, not one per call; a closed channel's successor
gets a client of its own pool."""

from __future__ import annotations

import threading

import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from payment_worker.worker.broker_transport import TRANSPORT, Channel
from payment_worker.worker.celery_app import app
from tests.conftest import PwEnv

_Q = Queue("pw-transport-test", Exchange("pw-transport-test"), routing_key="pw-transport-test")


def _unacked(url: str) -> int:
    return int(redis.Redis.from_url(url).hlen("unacked"))


def test_the_workers_celery_uses_it_for_a_redis_broker(pw_env: PwEnv) -> None:
    with app.connection_for_write() as conn:
        assert isinstance(conn.default_channel, Channel)


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
