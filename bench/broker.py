"""CPU per message of kombu's Redis transport: kombu's own against ours (issue 13).

    .venv/bin/python bench/broker.py                    # 2,000 messages, 3 alternating rounds
    .venv/bin/python bench/broker.py --messages 5000 --rounds 5

One thread, the broker Redis of the scratch environment (bench/_env.py: REDIS_URL, or the
embedded one). Each round publishes M messages of a task's size to a queue of its own, then
consumes and acks them all as a worker's consumer does (``no_ack`` off: kombu records each
delivered message as unacked, then removes the record at the ack). Process CPU
(``time.process_time``) per message, for kombu's ``redis`` transport and for
``payment_worker.worker.broker_transport`` (one reused ``redis.Redis`` per channel),
alternated, so that a host whose speed drifts moves both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _env import git_rev, machine, scratch

from payment_worker.worker.broker_transport import TRANSPORT


def one_round(url: str, transport: str, messages: int) -> tuple[float, float]:
    """(publish, consume + ack) CPU µs per message."""
    from kombu import Connection, Consumer, Exchange, Producer, Queue

    queue = Queue("pw-bench-broker", Exchange("pw-bench-broker"), routing_key="pw-bench-broker")
    body = {"batch_id": "b" * 36, "account_id": "acct-0001", "pad": "x" * 300}
    with Connection(url, transport=transport) as conn:
        channel = conn.channel()
        queue(channel).declare()
        queue(channel).purge()
        producer = Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key)
        started = time.process_time()
        for _ in range(messages):
            producer.publish(body)
        publish = time.process_time() - started
        got = 0

        def on_message(_body: Any, message: Any) -> None:
            nonlocal got
            message.ack()
            got += 1

        with Consumer(conn.channel(), [queue], callbacks=[on_message]):
            started = time.process_time()
            while got < messages:
                conn.drain_events(timeout=10)
            consume = time.process_time() - started
    return publish / messages * 1e6, consume / messages * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sides = {"kombu `redis`": "redis", "broker_transport": TRANSPORT}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    with scratch() as (_db, _r_app, broker):
        for _ in range(args.rounds):
            for name, transport in sides.items():
                results[name].append(one_round(broker, transport, args.messages))
    print(f"# broker transport  machine: {machine()}  commit: {git_rev()}")
    print(f"# {args.messages:,} messages per round, {args.rounds} rounds alternated; medians\n")
    print("| transport | publish CPU µs/message | consume + ack CPU µs/message | rounds |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        pub = statistics.median(r[0] for r in rows)
        con = statistics.median(r[1] for r in rows)
        each = ", ".join(f"{p:.0f}/{c:.0f}" for p, c in rows)
        print(f"| {name} | {pub:,.0f} | {con:,.0f} | {each} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
