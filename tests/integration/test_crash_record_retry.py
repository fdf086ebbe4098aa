"""``payment_worker.dlq.record_crash`` (a crash record the hook could not write) is retried
until it is written, and is never dropped when its retry cannot be published: Celery's
``autoretry_for`` rejected the message without requeue then, and the record was gone (a
review found it). Postgres is really out of reach (a port nothing listens on); the
broker's refusal of the retry's publish is injected, as a broker failing between a
delivery and its retry is not something a test produces on cue."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery.canvas import Signature
from celery.exceptions import Reject, Retry
from kombu.exceptions import OperationalError

from payment_worker import runtime
from payment_worker.settings import DEAD_LETTER_RETRY_MAX_SECONDS
from payment_worker.worker import dlq
from tests.conftest import PwEnv

FIELDS: dict[str, Any] = {
    "task_name": "payment_worker.process_account_batch",
    "args": ["b-1"],
    "error_class": "RuntimeError",
    "error": "boom",
    "traceback_digest": "d",
    "batch_id": "b-1",
    "task_id": "t-1",
}


@pytest.fixture
def postgres_down(pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The task as a worker runs it (its fourth delivery), with Postgres out of reach."""
    # the task's request first: that loads Celery's configuration, with the real broker
    dlq.record_crash_task.push_request(
        id="t-1", retries=3, called_directly=False, args=[], kwargs=FIELDS
    )
    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1:1/postgres")
    runtime.reset()
    try:
        yield
    finally:
        dlq.record_crash_task.pop_request()
        runtime.reset()


@pytest.mark.parametrize("draw", ["random", "lowest", "highest"])
def test_a_failed_write_is_retried_with_a_jittered_backoff(
    postgres_down: None, pw_env: PwEnv, monkeypatch: pytest.MonkeyPatch, draw: str
) -> None:
    # Celery's full jitter is random.randrange(step + 1): its lowest draw, 0, once meant no
    # countdown at all (an immediate retry; this test failed one CI run in nine)
    if draw != "random":
        monkeypatch.setattr(random, "randrange", lambda stop: 0 if draw == "lowest" else stop - 1)
    with pytest.raises(Retry):
        dlq.record_crash_task.run(**FIELDS)
    # the retry is on the real broker's dlq queue, its fifth delivery, due within the backoff
    raw = redis.Redis.from_url(pw_env.broker_url).lrange("dlq", 0, -1)
    assert len(raw) == 1
    headers = json.loads(raw[0])["headers"]
    assert headers["retries"] == 4
    # full jitter over the fourth retry's step, 2**3 s (below DEAD_LETTER_RETRY_MAX_SECONDS),
    # and never less than a second
    assert isinstance(headers["eta"], str), headers
    wait = (datetime.fromisoformat(headers["eta"]) - datetime.now(UTC)).total_seconds()
    assert 0 <= wait <= min(2**3, DEAD_LETTER_RETRY_MAX_SECONDS)
    if draw == "lowest":
        assert wait >= 0.5
    if draw == "highest":
        assert wait >= 2**3 - 1


def test_a_retry_that_cannot_be_published_puts_the_message_back(
    postgres_down: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broker_down(*_: object, **__: object) -> None:
        raise OperationalError("Error 111 connecting to the broker")

    monkeypatch.setattr(Signature, "apply_async", broker_down)
    started = time.monotonic()
    with pytest.raises(Reject) as rejected:
        dlq.record_crash_task.run(**FIELDS)
    assert rejected.value.requeue is True
    # requeued, it comes back at once with the same count: a pause first (at least 1 s, the
    # backoff's draw up to 10 s), not a loop as fast as Postgres refuses
    assert 1.0 <= time.monotonic() - started < 10.5
