"""``payment-worker status BATCH_ID...|--all [--json]``: where batches stand.

Batches are written as their rows arrive from a server-side cursor, so ``--all`` over
hundreds of thousands of items starts printing at once and holds at most one batch (the
table) or one row (JSON) in memory.

JSON output is an array with one object per batch::

    [{"batch_id": "...", "account_id": "...", "status": "pending|processing|completed",
      "items": [{"transaction_id": "...", "status": "...", "attempts": 1,
                 "gateway_payment_id": "...", "last_error": null}]}]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import Counter
from collections.abc import Iterable
from typing import TextIO

from sqlalchemy.exc import SQLAlchemyError

from payment_worker.cli.common import Context, closed_output, database_error, json_text
from payment_worker.domain.statuses import TxStatus
from payment_worker.producer.status import BatchStatus, item_json, shown_error, stream_batches

_ERROR_WIDTH = 60


def write_json(batches: Iterable[BatchStatus], out: TextIO) -> list[str]:
    """Write the JSON array, one item per line, as rows arrive; returns the batch ids written."""
    seen: list[str] = []
    out.write("[")
    for n, batch in enumerate(batches):
        seen.append(batch.batch_id)
        opening = json_text(
            {"batch_id": batch.batch_id, "account_id": batch.account_id, "status": batch.status},
            out,
        )
        # the batch object without its closing brace, then its items one by one
        out.write(("\n" if n == 0 else ",\n") + opening[:-1] + ', "items": [')
        sep = "\n  "
        for row in batch.items:
            out.write(sep + json_text(item_json(row), out))
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


def write_table(batches: Iterable[BatchStatus], out: TextIO) -> list[str]:
    """Write a readable table per batch (header line with counts, then one line per item);
    returns the batch ids written."""
    seen: list[str] = []
    headers = ("TRANSACTION_ID", "STATUS", "ATTEMPTS", "GATEWAY_PAYMENT_ID", "LAST_ERROR")
    for batch in batches:
        seen.append(batch.batch_id)
        # one batch at a time (at most MAX_ITEMS_PER_BATCH rows), to size its columns
        cells = [
            (
                _cell(r.transaction_id),
                _cell(r.status),
                _cell(r.attempts),
                _cell(r.gateway_payment_id),
                _cell(shown_error(r.last_error), _ERROR_WIDTH),
            )
            for r in batch.items
        ]
        counts = Counter(c[1] for c in cells)
        summary = " ".join(f"{s}={counts[s]}" for s in TxStatus if counts[s])
        out.write(
            f"{'' if len(seen) == 1 else chr(10)}batch {batch.batch_id}  account {batch.account_id}"
            f"  status {batch.status}  items {len(cells)}"
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


def status(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker status``: exit 0; 1 when a named batch does not exist or the database
    cannot be reached (with one line on stderr); 2 when no batch is named and no ``--all``."""
    if not args.batch_ids and not args.all:
        print("payment-worker status: name one or more BATCH_IDs, or --all", file=sys.stderr)
        return 2
    rt = ctx.runtime()
    wanted = None if args.all else list(dict.fromkeys(args.batch_ids))
    out = sys.stdout
    try:
        with rt.engine.connect() as conn:
            batches = stream_batches(conn, wanted)
            seen = write_json(batches, out) if args.json else write_table(batches, out)
        out.flush()
    except SQLAlchemyError as exc:
        print(f"payment-worker status: {database_error(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, and keep Python's exit-time flush
        # from raising again
        closed_output()
        return 1
    found = set(seen)
    missing = [b for b in wanted or [] if b not in found]
    for batch_id in missing:
        print(f"payment-worker status: no batch {batch_id!r}", file=sys.stderr)
    return 1 if missing else 0
