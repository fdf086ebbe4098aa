"""Submitting batches: validate, deduplicate, persist, then enqueue.

Order matters. The batch and its items are committed to PostgreSQL first, in one
transaction; only then is the batch id published to the broker. A broker that is down costs
nothing but latency: the batch waits as ``pending`` and the sweeper enqueues it.

Two dedup layers:

* a short Redis window (``SET NX EX``, ``DEDUP_WINDOW_SECONDS``) that remembers a batch_id's
  content fingerprint once PostgreSQL has it, so a burst of identical submissions is
  answered ``duplicate`` without touching the database; it is only ever set after a
  commit, so it can never claim a batch that was not saved, and it is skipped when Redis
  is unreachable;
* the real guard, PostgreSQL's unique constraints: the same batch_id with the same content
  is ``duplicate``, with other content ``rejected`` (conflict), and an item whose
  (account_id, transaction_id) belongs to another batch rejects the new batch.

Only an ``accepted`` submission publishes, so any number of identical submissions make one
broker message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import redis

from payment_worker.db import batches as db
from payment_worker.domain import batch_schema as schemas
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    BATCHES_SUBMITTED,
    ENQUEUE_FAILURES,
    SUBMIT_DUPLICATES,
)
from payment_worker.runtime import Runtime
from payment_worker.runtime import current as current_runtime

log = get_logger("producer")

Status = Literal["accepted", "duplicate", "rejected"]


@dataclass(frozen=True)
class SubmitResult:
    """The answer to one submission; ``errors`` are ``{"path", "message"}`` when rejected."""

    batch_id: str | None
    status: Status
    items: int
    errors: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The CLI's JSON line: ``{"batch_id", "status", "items", "errors"}``."""
        return {
            "batch_id": self.batch_id,
            "status": self.status,
            "items": self.items,
            "errors": list(self.errors),
        }


def submit_batch(
    batch: Mapping[str, Any] | str | bytes,
    *,
    runtime: Runtime | None = None,
    enqueue: bool = True,
) -> SubmitResult:
    """Validate and submit one batch (a decoded JSON object, or its JSON text).

    ``accepted``: committed to PostgreSQL, then published to the broker (a failed publish is
    logged; the sweeper enqueues the pending batch later). ``duplicate``: the same batch
    was submitted before, nothing changes. ``rejected``: invalid, or in conflict with what
    exists (see ``errors``); nothing is persisted. With ``enqueue=False`` nothing is
    published and the sweeper picks the batch up. Database errors propagate: the batch
    was most likely not saved, but a connection lost after its statement committed leaves
    it saved (and enqueued by the sweeper); submitting it again is safe either way (it is
    ``duplicate`` if it was saved).
    """
    result, _ = submit_one(batch, runtime or current_runtime(), enqueue=enqueue)
    return result


def submit_one(raw: object, rt: Runtime, *, enqueue: bool) -> tuple[SubmitResult, bool]:
    """One submission of anything (JSON text, or a decoded JSON value of any type), as
    :func:`submit_batch`; the bool says whether a publish was tried and failed, so that a
    caller with more batches can stop trying the broker."""
    result, failed = _submit_one(raw, rt, enqueue=enqueue)
    record_submission(rt, result.status)
    return result, failed


def record_submission(rt: Runtime, status: Status) -> None:
    """Count one submission where the exporter reads it (a Redis hash): the producer is
    often a short process nobody scrapes. Best effort: the submission stands either way."""
    try:
        rt.dedup_redis.hincrby(rt.keys.submissions(), status, 1)
    except redis.RedisError as exc:
        log.warning("submission_not_counted", status=status, error=str(exc))


def _submit_one(raw: object, rt: Runtime, *, enqueue: bool) -> tuple[SubmitResult, bool]:
    data: Any
    if isinstance(raw, str | bytes):
        try:
            data = schemas.loads(raw)
        except schemas.RefusedJSON as exc:
            return _rejected(None, 0, [{"path": "$", "message": str(exc)}]), False
        except ValueError as exc:
            return _rejected(None, 0, [{"path": "$", "message": f"not valid JSON: {exc}"}]), False
    else:
        data = dict(raw) if isinstance(raw, Mapping) else raw
    batch_id = data.get("batch_id") if isinstance(data, dict) else None
    batch_id = batch_id if isinstance(batch_id, str) else None
    raw_items = data.get("items") if isinstance(data, dict) else None
    count = len(raw_items) if isinstance(raw_items, list) else 0
    s = rt.settings
    try:
        batch = schemas.parse_batch(data, max_items=s.max_items_per_batch, max_amount=s.max_amount)
    except schemas.InvalidBatch as exc:
        return _rejected(batch_id, count, exc.errors), False

    requests = batch.payment_requests()
    item_fps = [r.fingerprint() for r in requests]
    fp = schemas.batch_fingerprint(
        batch.batch_id,
        batch.account_id,
        [(r.transaction_id, f) for r, f in zip(requests, item_fps, strict=True)],
    )
    window = _DedupWindow(rt)
    # the window spares the insert of every item, never the word of Postgres: after a
    # failover that lost commits, a restore, or another deployment on the same Redis, a
    # batch the window knows may not be saved, and "duplicate" would mean it is never paid
    if window.seen(batch.batch_id, fp) and db.saved_fingerprint(rt.engine, batch.batch_id) == fp:
        SUBMIT_DUPLICATES.labels(layer="redis").inc()
        return _counted(SubmitResult(batch.batch_id, "duplicate", count)), False

    new = db.NewBatch(
        batch_id=batch.batch_id,
        account_id=batch.account_id,
        fingerprint=fp,
        transactions=[
            db.NewTransaction(
                transaction_id=r.transaction_id,
                amount=r.amount,
                currency=r.currency,
                beneficiary=r.beneficiary,
                description=r.description,
                idempotency_key=r.idempotency_key,
                request_fingerprint=item_fp,
            )
            for r, item_fp in zip(requests, item_fps, strict=True)
        ],
    )
    outcome = db.insert_batch(rt.engine, new)
    if outcome.status == "conflict":
        msg = f"batch_id {batch.batch_id!r} already exists with different content"
        return _rejected(batch.batch_id, count, [{"path": "$.batch_id", "message": msg}]), False
    if outcome.status == "transactions_exist":
        errors = [
            {
                "path": f"$.items[{c.index}].transaction_id",
                "message": f"transaction_id {c.transaction_id!r} of account "
                f"{batch.account_id!r} already exists in batch {c.other_batch_id!r}",
            }
            for c in outcome.clashes
        ]
        return _rejected(batch.batch_id, count, errors), False
    window.remember(batch.batch_id, fp)
    if outcome.status == "duplicate":
        SUBMIT_DUPLICATES.labels(layer="postgres").inc()
        return _counted(SubmitResult(batch.batch_id, "duplicate", count)), False

    log.info("batch_accepted", batch_id=batch.batch_id, items=count)
    failed = False
    if enqueue:
        failed = not _enqueue(batch.batch_id, rt, batch.account_id)
    return _counted(SubmitResult(batch.batch_id, "accepted", count)), failed


def reject_unreadable(message: str, rt: Runtime | None = None) -> SubmitResult:
    """The (counted) answer for a batch that could not even be read as JSON: ``batch_id``
    null, one error at ``$`` saying why; counted for the exporter too when ``rt`` is given."""
    result = _rejected(None, 0, [{"path": "$", "message": message}])
    if rt is not None:
        record_submission(rt, result.status)
    return result


def _rejected(batch_id: str | None, items: int, errors: list[dict[str, str]]) -> SubmitResult:
    return _counted(SubmitResult(batch_id, "rejected", items, errors))


def _counted(result: SubmitResult) -> SubmitResult:
    BATCHES_SUBMITTED.labels(status=result.status).inc()
    return result


def _enqueue(batch_id: str, rt: Runtime, account_id: str) -> bool:
    """Publish the batch id (the account marked queued); False (logged, counted) when the
    broker cannot take it."""
    from payment_worker.worker.queueing import enqueue_batch  # imports Celery: only when publishing

    try:
        enqueue_batch(batch_id, rt=rt, account_id=account_id)
    except Exception as exc:  # any broker failure: the batch is safe in Postgres already
        ENQUEUE_FAILURES.inc()
        log.warning(
            "enqueue_failed",
            batch_id=batch_id,
            error=f"{type(exc).__name__}: {exc}",
            note="the batch is saved as pending; the sweeper will pick it up",
        )
        return False
    return True


class _DedupWindow:
    """The Redis layer: batch_id → content fingerprint, for ``DEDUP_WINDOW_SECONDS``."""

    def __init__(self, rt: Runtime) -> None:
        self._ttl = rt.settings.dedup_window_seconds
        self._keys = rt.keys
        # short timeouts: a slow Redis must not stall submission, Postgres decides
        self._client = rt.dedup_redis

    def seen(self, batch_id: str, fp: str) -> bool:
        """True when this batch_id was saved with this very content within the window."""
        try:
            return self._client.get(self._keys.submit_dedup(batch_id)) == fp.encode()
        except redis.RedisError as exc:
            log.warning("dedup_window_unavailable", error=str(exc))
            return False

    def remember(self, batch_id: str, fp: str) -> None:
        """Open the window; NX, so repeats never stretch it beyond its first TTL."""
        try:
            self._client.set(self._keys.submit_dedup(batch_id), fp, nx=True, ex=self._ttl)
        except redis.RedisError as exc:
            log.warning("dedup_window_unavailable", error=str(exc))
