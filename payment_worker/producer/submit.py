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

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import redis
from sqlalchemy.exc import SQLAlchemyError

from payment_worker.db import batches as db
from payment_worker.domain import batch_schema as schemas
from payment_worker.errors import PaymentWorkerError
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
    was then not submitted.
    """
    result, _ = _submit(batch, runtime or current_runtime(), enqueue=enqueue)
    return result


def _submit(raw: object, rt: Runtime, *, enqueue: bool) -> tuple[SubmitResult, bool]:
    """One submission of anything (JSON text, or a decoded JSON value of any type); the bool
    says whether a publish was tried and failed."""
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
    if window.seen(batch.batch_id, fp):
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
        failed = not _enqueue(batch.batch_id)
    return _counted(SubmitResult(batch.batch_id, "accepted", count)), failed


def _rejected(batch_id: str | None, items: int, errors: list[dict[str, str]]) -> SubmitResult:
    return _counted(SubmitResult(batch_id, "rejected", items, errors))


def _counted(result: SubmitResult) -> SubmitResult:
    BATCHES_SUBMITTED.labels(status=result.status).inc()
    return result


def _enqueue(batch_id: str) -> bool:
    """Publish the batch id; False (logged, counted) when the broker cannot take it."""
    from payment_worker.worker.queueing import enqueue_batch  # imports Celery: only when publishing

    try:
        enqueue_batch(batch_id)
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


class InputError(PaymentWorkerError):
    """The submitted input as a whole is unreadable (not JSON, too deep, no such file)."""


def _read(source: str) -> str:
    if source == "-" and sys.stdin is None:  # started with stdin closed (``<&-``)
        raise InputError("cannot read -: standard input is closed")
    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
        return raw.decode("utf-8-sig")
    except OSError as exc:
        raise InputError(f"cannot read {source}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{source} is not UTF-8 text: {exc}") from None


def iter_documents(text: str) -> Iterator[Any | InputError]:
    """The batches of an input: one JSON object, a JSON array of them, or JSON lines.

    A JSON-lines line that does not parse comes out as an :class:`InputError` in its place,
    so the other lines are still handled; input that is none of the three raises it.
    """
    try:
        whole = schemas.loads(text)
    except ValueError as exc:
        whole_error: ValueError | None = exc
    else:
        whole_error = None
        if isinstance(whole, list):
            yield from whole
        else:
            yield whole
        return
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    first = _try_line(lines[0][1]) if lines else None
    # only a first line that is a whole JSON object on its own makes this JSON lines;
    # otherwise it is one broken JSON document, and the message should say where
    if not isinstance(first, dict):
        raise InputError(_unparsed("input", whole_error))
    for n, line in lines:
        try:
            yield schemas.loads(line)
        except ValueError as exc:
            yield InputError(_unparsed(f"line {n}", exc))


def _unparsed(what: str, exc: ValueError | None) -> str:
    # too deep, or a lone surrogate, is well-formed JSON that is refused: not "invalid"
    verdict = "is refused" if isinstance(exc, schemas.RefusedJSON) else "is not valid JSON"
    return f"{what} {verdict}: {exc}"


def _try_line(line: str) -> Any:
    try:
        return schemas.loads(line)
    except ValueError:
        return None


def cli_submit(source: str, make_runtime: Callable[[], Runtime]) -> int:
    """``payment-worker submit FILE|-``: one JSON line per batch on stdout.

    Exit code 0 when every batch was accepted or duplicate; 2 when any was rejected or the
    input is not JSON; 1 when the database failed (batches after the reported one were not
    tried). After one failed publish the remaining batches are not published: they are
    saved as pending and the sweeper enqueues them.
    """
    try:
        documents = list(iter_documents(_read(source)))
    except InputError as exc:
        print(f"payment-worker submit: {exc}", file=sys.stderr)
        return 2
    if not documents:
        print("payment-worker submit: the input holds no batch", file=sys.stderr)
        return 2
    rt = make_runtime()  # after the input was read: a bad file needs no database
    rc = 0
    enqueue = True
    for doc in documents:
        if isinstance(doc, InputError):
            result = _rejected(None, 0, [{"path": "$", "message": str(doc)}])
        else:
            try:
                result, failed = _submit(doc, rt, enqueue=enqueue)
            except SQLAlchemyError as exc:
                where = doc.get("batch_id") if isinstance(doc, dict) else None
                print(
                    f"payment-worker submit: database error at batch {where!r}, "
                    f"it and the batches after it were not submitted: {exc}",
                    file=sys.stderr,
                )
                return 1
            if failed:
                enqueue = False
                print(
                    "payment-worker submit: the broker is unreachable; accepted batches are "
                    "saved as pending and the sweeper will enqueue them",
                    file=sys.stderr,
                )
        if result.status == "rejected":
            rc = 2
        print(json.dumps(result.to_json(), ensure_ascii=False), flush=True)
    return rc
