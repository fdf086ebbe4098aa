"""The account's one delayed message (``worker.queueing.schedule``): real Redis and broker.

The ``scheduled`` marker holds the due time of the message on its way. A later reschedule
sends nothing; an earlier one replaces the marker and is published, so a retry runs after
its own backoff; the delayed task clears the marker when it runs, so the next reschedule is
published at once instead of waiting for the sweeper. Messages are read in the broker itself
(kombu's Redis transport keeps the ``payments`` queue as a list; a countdown is an ``eta``
header, the message is there at once).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest
import redis

from payment_worker import lua, runtime
from payment_worker.dev.samples import make_batches
from payment_worker.producer.submit import submit_batch
from payment_worker.worker import tasks
from payment_worker.worker.queueing import schedule
from tests.conftest import PwEnv
from tests.lock_helpers import proxied_redis
from tests.sim_fixtures import SimHandle

ACCT = "acct-0000"


@dataclass(frozen=True)
class Message:
    args: list[Any]
    kwargs: dict[str, Any]
    eta: datetime | None


def _messages(env: PwEnv) -> list[Message]:
    """The ``payments`` queue, oldest first."""
    out = []
    for raw in reversed(redis.Redis.from_url(env.broker_url).lrange("payments", 0, -1)):
        msg = json.loads(raw)
        assert msg["headers"]["task"] == "payment_worker.process_account_batch"
        args, kwargs, _embed = json.loads(base64.b64decode(msg["body"]))
        eta = msg["headers"].get("eta")
        out.append(Message(args, kwargs, datetime.fromisoformat(eta) if eta else None))
    return out


def _marker(rt: runtime.Runtime) -> dict[str, str]:
    raw = rt.redis.hgetall(rt.keys.scheduled(ACCT))
    return {k.decode(): v.decode() for k, v in raw.items()}


def _server_ms(rt: runtime.Runtime) -> int:
    seconds, micros = rt.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.fixture
def rt(pw_env: PwEnv) -> Iterator[runtime.Runtime]:
    yield runtime.current()


def test_a_later_reschedule_sends_nothing(rt: runtime.Runtime, pw_env: PwEnv) -> None:
    before = _server_ms(rt)
    assert schedule(rt, ACCT, "b-1", 10.0) == 10.0
    [first] = _messages(pw_env)
    marker = _marker(rt)
    due = int(marker["due"])
    assert marker["batch"] == "b-1" and before + 10_000 <= due <= _server_ms(rt) + 10_000
    # the message names its marker, so that its run clears it; producers' messages do not
    assert first.args == ["b-1"] and first.kwargs == {"scheduled_due_ms": due}
    # a later retry, and one due a few ms after the first: the first message covers both;
    # so does one due a little earlier (the same item rescheduled, measured a bit apart)
    schedule(rt, ACCT, "b-2", 20.0)
    schedule(rt, ACCT, "b-2", 10.0)
    schedule(rt, ACCT, "b-2", 9.5)
    assert _messages(pw_env) == [first] and _marker(rt) == marker
    # the marker lives until its message is due, plus a little
    assert 10_000 < rt.redis.pttl(rt.keys.scheduled(ACCT)) <= 15_000


def test_an_earlier_reschedule_replaces_the_marker_and_is_published(
    rt: runtime.Runtime, pw_env: PwEnv
) -> None:
    schedule(rt, ACCT, "b-1", 60.0)
    later_due = int(_marker(rt)["due"])
    # a retry with a shorter backoff (a 503 after a 429's long Retry-After): runs on its own
    # time, not after the 60 s already scheduled
    schedule(rt, ACCT, "b-2", 2.0)
    later, earlier = _messages(pw_env)
    marker = _marker(rt)
    assert marker["batch"] == "b-2" and int(marker["due"]) < later_due - 50_000
    assert earlier.kwargs == {"scheduled_due_ms": int(marker["due"])}
    assert later.eta is not None and earlier.eta is not None
    assert (later.eta - earlier.eta).total_seconds() == pytest.approx(58.0, abs=1.0)
    assert rt.redis.pttl(rt.keys.scheduled(ACCT)) <= 7_000
    # and between the two, a third one is not needed
    schedule(rt, ACCT, "b-3", 30.0)
    assert len(_messages(pw_env)) == 2


def test_a_marker_of_the_previous_version_is_honoured(rt: runtime.Runtime, pw_env: PwEnv) -> None:
    # a string with the batch id, expiring 5 s after its (30 s) message is due
    rt.redis.set(rt.keys.scheduled(ACCT), "b-old", px=35_000)
    schedule(rt, ACCT, "b-1", 40.0)
    assert _messages(pw_env) == []  # the old message comes first
    schedule(rt, ACCT, "b-1", 5.0)
    [message] = _messages(pw_env)  # earlier: replaces it
    assert message.kwargs == {"scheduled_due_ms": int(_marker(rt)["due"])}


def test_the_delayed_task_clears_its_marker_when_it_runs(
    rt: runtime.Runtime,
    pw_env: PwEnv,
    gateway_sim: SimHandle,
    db_conn: psycopg.Connection[Any],
) -> None:
    [batch] = make_batches(batches=1, items=2, accounts=1, prefix="d")
    assert submit_batch(batch, enqueue=False).status == "accepted"
    batch_id = batch["batch_id"]
    rt = runtime.current()  # GATEWAY_URL changed: the fixture rebuilt the runtime
    # the items wait for a retry in 60 s: a run now finds nothing due and schedules again
    db_conn.execute("UPDATE transactions SET next_attempt_at = now() + interval '60 seconds'")
    schedule(rt, ACCT, batch_id, 30.0)  # as after an earlier attempt
    schedule(rt, ACCT, batch_id, 1.0)  # a shorter retry since: replaces the marker
    stale, current = _messages(pw_env)
    # the replaced message runs (delivered early, say): not its marker, left alone
    tasks.process_account_batch(*stale.args, **stale.kwargs)
    assert int(_marker(rt)["due"]) == current.kwargs["scheduled_due_ms"]
    assert len(_messages(pw_env)) == 2  # its drain found the marker's message on its way
    # the current one runs: its marker is cleared before it drains, so the drain's own
    # reschedule (the items are due in 60 s) is published at once
    t0 = time.monotonic()
    tasks.process_account_batch(*current.args, **current.kwargs)
    assert time.monotonic() - t0 < 5.0
    rescheduled = _messages(pw_env)[2:]
    assert len(rescheduled) == 1 and rescheduled[0].args == [batch_id]
    marker = _marker(rt)
    assert rescheduled[0].kwargs == {"scheduled_due_ms": int(marker["due"])}
    assert int(marker["due"]) - _server_ms(rt) == pytest.approx(60_000, abs=2_000)
    # nothing was due: nothing was sent
    assert gateway_sim.ledger()["payments_sent"] == 0
    # a producer's message (no keyword) never touches the marker
    tasks.process_account_batch(batch_id)
    assert _marker(rt) == marker


def test_a_claim_retried_after_its_lost_reply_still_publishes(
    rt: runtime.Runtime, pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py sends the claim again after a lost reply (the runtime's client keeps its
    retries): the retry finds the marker its first run wrote and is answered as that run
    was, so the message is published. Before, the retry found a message "on its way" that
    was never sent, and the account's retries waited for the marker to expire and the
    sweeper. The reply is lost for real: a TCP proxy in front of Redis throws it away."""
    with proxied_redis(pw_env.redis_url) as (proxy, client):
        client.script_load(lua.load("schedule_claim"))  # the reply lost is of a run
        monkeypatch.setattr(rt, "redis", client)
        proxy.drop_next_reply.set()
        schedule(rt, ACCT, "b-1", 10.0)
        assert not proxy.drop_next_reply.is_set()  # a reply was lost
        [message] = _messages(pw_env)
        assert message.kwargs == {"scheduled_due_ms": int(_marker(rt)["due"])}
