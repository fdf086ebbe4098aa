"""``payment-worker db`` and ``payment-worker services``: the schema, and the embedded
PostgreSQL and Redis."""

from __future__ import annotations

import argparse
import sys

from payment_worker import embedded
from payment_worker.cli.common import Context
from payment_worker.ops.redaction import mask_url
from payment_worker.runtime import ServiceUrls


def db(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker db upgrade|downgrade|current [REVISION]`` (alembic)."""
    from payment_worker.db import migrate

    url = ServiceUrls.resolve(ctx.settings).sqlalchemy
    try:
        if args.action == "upgrade":
            migrate.upgrade(url, revision=args.revision or "head")
            print(f"database schema is at {args.revision or 'head'}")
        elif args.action == "downgrade":
            migrate.downgrade(url, revision=args.revision or "base")
            print(f"database schema downgraded to {args.revision or 'base'}")
        else:
            migrate.current(url)
    except migrate.MigrationLockTimeout as exc:
        print(f"payment-worker db {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def services(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker services start|stop|status``: the embedded servers of the home."""
    s = ctx.settings
    home = s.home
    if args.action == "stop":
        stopped = embedded.stop(home)
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    elif args.action == "start":
        urls = ServiceUrls.resolve(s)
        # where the servers are, never their passwords
        print(f"postgres: {mask_url(urls.database)}")
        print(f"redis:    {mask_url(urls.redis)}")
    else:
        for name, state in embedded.status(home).items():
            print(f"{name}: {state}")
        if s.database_url or s.redis_url:
            print("note: DATABASE_URL/REDIS_URL are set; the embedded servers are not used")
    return 0
