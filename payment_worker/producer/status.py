"""Where batches stand: ``payment-worker status BATCH_ID...|--all [--json]``.

Rows are streamed from a server-side cursor and written as they arrive, so ``--all`` over
hundreds of thousands of items starts printing at once and holds at most one batch (the
table) or one row (JSON) in memory.

JSON output is an array with one object per batch::

    [{"batch_id": "...", "account_id": "...", "status": "pending|processing|completed",
      "items": [{"transaction_id": "...", "status": "...", "attempts": 1,
                 "gateway_payment_id": "...", "last_error": null}]}]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from payment_worker.db.batches import StatusRow, stream_status
from payment_worker.domain.statuses import TxStatus
from payment_worker.runtime import Runtime

_ERROR_WIDTH = 60


def item_json(row: StatusRow) -> dict[str, Any]:
    """One item of the JSON output."""
    return {
        "transaction_id": row.transaction_id,
        "status": row.status,
        "attempts": row.attempts,
        "gateway_payment_id": row.gateway_payment_id,
        "last_error": row.last_error,
    }


def _batches(rows: Iterable[StatusRow]) -> Iterable[tuple[StatusRow, Iterable[StatusRow]]]:
    # rows come ordered by batch, so consecutive rows of one batch_id are that whole batch
    for _, group in itertools.groupby(rows, key=lambda r: r.batch_id):
        first = next(group)
        # consumed once, by the caller, before the next batch is asked for
        yield first, itertools.chain([first], group)  # noqa: B031


def write_json(rows: Iterable[StatusRow], out: TextIO) -> list[str]:
    """Write the JSON array, one item per line, as rows arrive; returns the batch ids written."""
    seen: list[str] = []
    out.write("[")
    for n, (head, items) in enumerate(_batches(rows)):
        seen.append(head.batch_id)
        opening = json.dumps(
            {"batch_id": head.batch_id, "account_id": head.account_id, "status": head.batch_status},
            ensure_ascii=False,
        )
        # the batch object without its closing brace, then its items one by one
        out.write(("\n" if n == 0 else ",\n") + opening[:-1] + ', "items": [')
        sep = "\n  "
        for row in items:
            if row.transaction_id is None:
                continue
            out.write(sep + json.dumps(item_json(row), ensure_ascii=False))
            sep = ",\n  "
        out.write("\n]}" if sep != "\n  " else "]}")
    out.write("\n]\n" if seen else "]\n")
    return seen


def _cell(value: object, width: int | None = None) -> str:
    text = "-" if value is None else str(value)
    text = text.replace("\n", " ")
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return text


def write_table(rows: Iterable[StatusRow], out: TextIO) -> list[str]:
    """Write a readable table per batch (header line with counts, then one line per item)."""
    seen: list[str] = []
    headers = ("TRANSACTION_ID", "STATUS", "ATTEMPTS", "GATEWAY_PAYMENT_ID", "LAST_ERROR")
    for head, items in _batches(rows):
        seen.append(head.batch_id)
        # one batch at a time (at most MAX_ITEMS_PER_BATCH rows), to size its columns
        cells = [
            (
                _cell(r.transaction_id),
                _cell(r.status),
                _cell(r.attempts),
                _cell(r.gateway_payment_id),
                _cell(r.last_error, _ERROR_WIDTH),
            )
            for r in items
            if r.transaction_id is not None
        ]
        counts = Counter(c[1] for c in cells)
        summary = " ".join(f"{s}={counts[s]}" for s in TxStatus if counts[s])
        out.write(
            f"{'' if len(seen) == 1 else chr(10)}batch {head.batch_id}  account {head.account_id}"
            f"  status {head.batch_status}  items {len(cells)}"
            + (f"  ({summary})" if summary else "")
            + "\n"
        )
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
        for line in itertools.chain([headers], cells):
            out.write(
                "  "
                + "  ".join(
                    v.rjust(w) if i == 2 else v.ljust(w)
                    for i, (v, w) in enumerate(zip(line, widths, strict=True))
                ).rstrip()
                + "\n"
            )
    return seen


def render(
    conn: Connection, batch_ids: Sequence[str] | None, out: TextIO, *, as_json: bool
) -> list[str]:
    """Stream the status of the named batches (every batch when None) to ``out``."""
    rows = stream_status(conn, batch_ids)
    return write_json(rows, out) if as_json else write_table(rows, out)


def cli_status(batch_ids: list[str], rt: Runtime, *, all_batches: bool, as_json: bool) -> int:
    """``payment-worker status``: exit 0, or 1 when a named batch does not exist or the
    database cannot be reached (with one line on stderr)."""
    wanted = None if all_batches else list(dict.fromkeys(batch_ids))
    out = sys.stdout
    try:
        with rt.engine.connect() as conn:
            seen = render(conn, wanted, out, as_json=as_json)
        out.flush()
    except SQLAlchemyError as exc:
        print(f"payment-worker status: database error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, and keep Python's exit-time flush
        # from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    found = set(seen)
    missing = [b for b in wanted or [] if b not in found]
    for batch_id in missing:
        print(f"payment-worker status: no batch {batch_id!r}", file=sys.stderr)
    return 1 if missing else 0
