"""Messages waiting in the broker, read the way kombu's Redis transport stores them.

Kombu keeps each queue as a Redis list named after the queue, one list per priority step
(``payments``, then ``payments\\x06\\x163``, ``...6``, ``...9``). A message a worker has
taken but not acknowledged sits in the ``unacked`` hash (delivery tag -> ``[message,
exchange, routing key]``) and the ``unacked_index`` sorted set. A message with an ETA or a
countdown (our retries and hand-backs, worker/queueing.py) is taken at once by a worker,
which holds it unacknowledged until it is due: so the delayed messages are the unacked ones
whose ``eta`` header is still in the future (the others are tasks running, with acks_late).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import redis

# kombu.transport.redis: Channel.sep, PRIORITY_STEPS, Channel.unacked_key (the defaults we
# run with: no priority_steps, unacked_key or global_keyprefix transport option is set)
_SEP = "\x06\x16"
_PRIORITY_STEPS = (0, 3, 6, 9)
_UNACKED = "unacked"
_SCAN_BATCH = 500


def queue_keys(queue: str) -> list[str]:
    """The Redis lists that hold ``queue``'s messages, one per priority step."""
    return [queue if step == 0 else f"{queue}{_SEP}{step}" for step in _PRIORITY_STEPS]


def waiting(client: redis.Redis, queues: list[str]) -> dict[str, int]:
    """Messages waiting (not yet taken by a worker) in each queue."""
    pipe = client.pipeline(transaction=False)
    for q in queues:
        for key in queue_keys(q):
            pipe.llen(key)
    lengths = iter(pipe.execute())
    return {q: sum(int(next(lengths)) for _ in _PRIORITY_STEPS) for q in queues}


def _eta(raw: bytes) -> datetime | None:
    try:
        message = json.loads(raw)[0]
        eta = message.get("headers", {}).get("eta")
        if not eta:
            return None
        when = datetime.fromisoformat(eta)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # not a Celery message we can read: not counted as delayed
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def delayed(client: redis.Redis, now: datetime | None = None) -> int:
    """Messages a worker holds for later: unacknowledged, with an ETA still in the future."""
    now = now or datetime.now(UTC)
    count = 0
    for _, raw in client.hscan_iter(_UNACKED, count=_SCAN_BATCH):
        eta = _eta(raw)
        if eta is not None and eta > now:
            count += 1
    return count


def oldest_enqueued_ms(client: redis.Redis, queue: str, header: str) -> int | None:
    """When the oldest message waiting in ``queue`` was published: its ``header`` (ms since
    the epoch, set by our publisher), or None when the queue is empty or the message has no
    such header. Kombu pushes on the left and takes from the right, so the oldest message
    of each priority list is at index -1: one ``LINDEX`` per list, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for key in queue_keys(queue):
        pipe.lindex(key, -1)
    found: list[int] = []
    for raw in pipe.execute():
        if raw is None:
            continue
        try:
            value = json.loads(raw).get("headers", {}).get(header)
        except (ValueError, TypeError, AttributeError):
            continue  # not a message we can read
        if isinstance(value, int | float):
            found.append(int(value))
    return min(found, default=None)
