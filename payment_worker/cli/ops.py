"""``payment-worker sweep`` and ``payment-worker exporter``: operating a running system."""

from __future__ import annotations

import argparse
import json

from payment_worker.cli.common import Context


def sweep(_: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker sweep``: one sweeper pass now; its summary as one JSON line."""
    from payment_worker.worker.sweeper import run_sweep

    print(json.dumps(run_sweep(ctx.runtime())))
    return 0


def exporter(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker exporter [--host H] [--port P]``: serve the Postgres state gauges."""
    from payment_worker.ops.exporter import serve

    port = args.port if args.port is not None else ctx.settings.exporter_port
    serve(port, ctx.runtime().engine, host=args.host)
    return 0
