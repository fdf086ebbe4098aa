"""``payment-worker status BATCH_ID...|--all [--json]``."""

from __future__ import annotations

import argparse
import sys

from payment_worker.cli.common import Context


def status(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker status``: where the named batches (or all) stand."""
    from payment_worker.producer.status import cli_status

    if not args.batch_ids and not args.all:
        print("payment-worker status: name one or more BATCH_IDs, or --all", file=sys.stderr)
        return 2
    return cli_status(args.batch_ids, ctx.runtime(), all_batches=args.all, as_json=args.json)
