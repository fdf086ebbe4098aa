"""``payment-worker submit FILE|-``: read the input, submit each batch, one JSON line each.

The submitting itself is :func:`payment_worker.producer.submit.submit_one`; this module owns
everything about the input (file or stdin, one object, an array or JSON lines), the output
and the exit codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from payment_worker.cli.common import Context, closed_output, database_error, json_text
from payment_worker.domain import batch_schema as schemas
from payment_worker.errors import PaymentWorkerError


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
    # JSON lines end at "\n" (a "\r" before it is dropped), not at every line break
    # str.splitlines knows: a U+2028 inside a string is part of its line
    lines = [
        (n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()
    ]
    # only a first line that is a whole JSON object on its own, with more lines after it,
    # makes this JSON lines (one that is refused, a duplicate key, is still such a line,
    # rejected alone below); otherwise it is one broken JSON document, and the message
    # should say where
    if len(lines) < 2 or not _is_object_text(lines[0][1]):
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


def _is_object_text(line: str) -> bool:
    """Whether ``line`` is one JSON object by its syntax alone (duplicate keys and the like
    are for the strict parse to refuse)."""
    try:
        schemas.check_depth(line)  # the plain parse below must not recurse without a bound
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def submit(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker submit FILE|-``: one JSON line per batch on stdout.

    Exit code 0 when every batch was accepted or duplicate; 2 when any was rejected or the
    input is not JSON; 1 when the database failed (batches after the reported one were not
    tried). After one failed publish the remaining batches are not published: they are
    saved as pending and the sweeper enqueues them.
    """
    # here, not at the top: the other commands need not load the producer and its metrics
    from payment_worker.producer.submit import reject_unreadable, submit_one

    source: str = args.file
    try:
        documents = list(iter_documents(_read(source)))
    except InputError as exc:
        print(f"payment-worker submit: {exc}", file=sys.stderr)
        return 2
    if not documents:
        print("payment-worker submit: the input holds no batch", file=sys.stderr)
        return 2
    rt = ctx.runtime()  # after the input was read: a bad file needs no database
    rc = 0
    enqueue = True
    for doc in documents:
        if isinstance(doc, InputError):
            result = reject_unreadable(str(doc), rt)
        else:
            try:
                result, failed = submit_one(doc, rt, enqueue=enqueue)
            except SQLAlchemyError as exc:
                where = doc.get("batch_id") if isinstance(doc, dict) else None
                print(
                    f"payment-worker submit: database error at batch {where!r}: it was most "
                    "likely not saved, and the batches after it were not tried (submitting "
                    f"them again is safe: a saved batch answers duplicate): {database_error(exc)}",
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
        try:
            print(json_text(result.to_json()), flush=True)
        except BrokenPipeError:
            closed_output()
            print(
                f"payment-worker submit: the output was closed after batch "
                f"{result.batch_id!r} was {result.status} (its line could not be written); "
                "the batches after it were not submitted",
                file=sys.stderr,
            )
            return 1
    return rc
