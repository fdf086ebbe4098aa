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
    """``payment-worker exporter [--host H] [--port P]``: serve the state gauges (Postgres,
    the broker's queues, workers alive, submissions)."""
    from payment_worker.ops.exporter import Sources, celery_ping, serve

    port = args.port if args.port is not None else ctx.settings.exporter_port
    rt = ctx.runtime()
    # the runtime's broker client (short timeouts: a broker that hangs costs one scrape's
    # figures, never the endpoint); None for a broker that is not Redis: no queue depths
    sources = Sources(rt.engine, rt.redis, rt.broker_redis, rt.keys, ping=celery_ping)
    serve(port, sources, ctx.settings.exporter_cache_seconds, host=args.host)
    return 0
