"""``payment-worker submit FILE|-``."""

from __future__ import annotations

import argparse

from payment_worker.cli.common import Context


def submit(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker submit FILE|-``: one JSON line per batch on stdout."""
    from payment_worker.producer.submit import cli_submit

    return cli_submit(args.file, ctx.runtime)
