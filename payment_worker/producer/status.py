"""Where batches stand, as data: one :class:`BatchStatus` per batch, with its items.

Built on :func:`payment_worker.db.batches.stream_status`, rows from a server-side cursor in
batch order: batches and their items are yielded as the rows arrive, so a caller that writes
them out as it goes holds one row at a time, however many items there are. The command line
renders them (``payment_worker.cli.status``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from payment_worker.db.batches import StatusRow, stream_status
from payment_worker.ops.redaction import redact


@dataclass(frozen=True)
class BatchStatus:
    """One batch, and its items in order (rows whose item fields are all set).

    ``items`` is a one-shot iterator over the shared stream of rows: consume it before
    asking for the next batch.
    """

    batch_id: str
    account_id: str
    status: str
    items: Iterator[StatusRow]


def batch_statuses(rows: Iterable[StatusRow]) -> Iterator[BatchStatus]:
    """Group status rows, ordered by batch, into batches without reading ahead."""
    # rows come ordered by batch, so consecutive rows of one batch_id are that whole batch
    for _, group in itertools.groupby(rows, key=lambda r: r.batch_id):
        first = next(group)
        # consumed once, by the caller, before the next batch is asked for; a batch without
        # items is one row whose item fields are None
        items = (r for r in itertools.chain([first], group) if r.transaction_id is not None)
        yield BatchStatus(first.batch_id, first.account_id, first.batch_status, items)


def stream_batches(conn: Connection, batch_ids: Sequence[str] | None) -> Iterator[BatchStatus]:
    """The named batches (every batch when None), in submission order, streamed from
    ``conn``, which must stay open while they are consumed."""
    return batch_statuses(stream_status(conn, batch_ids))


def item_json(row: StatusRow) -> dict[str, Any]:
    """One item as a JSON object."""
    return {
        "transaction_id": row.transaction_id,
        "status": row.status,
        "attempts": row.attempts,
        "gateway_payment_id": row.gateway_payment_id,
        "last_error": shown_error(row.last_error),
    }


def shown_error(error: str | None) -> str | None:
    """A stored error as it may be shown: URL passwords and account numbers masked (rows
    written before errors were masked at the source, or by another writer)."""
    return None if error is None else redact(error)
