"""The ``payment-worker`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from payment_worker import embedded, runtime
from payment_worker.runtime import Runtime, ServiceUrls
from payment_worker.settings import Settings, SettingsError, load_settings


@dataclass
class Context:
    """What a command is handed: the settings, and this process's runtime on first use (a
    command that only reads its input never starts a server)."""

    settings: Settings
    _runtime: Runtime | None = field(default=None, repr=False)

    def runtime(self) -> Runtime:
        """The process's runtime, built on first use."""
        if self._runtime is None:
            self._runtime = runtime.install(Runtime(self.settings))
        return self._runtime


def _db(args: argparse.Namespace, ctx: Context) -> int:
    from payment_worker.db import migrate

    url = ServiceUrls.resolve(ctx.settings).sqlalchemy
    if args.action == "upgrade":
        migrate.upgrade(url, revision=args.revision or "head")
        print("database schema is at head")
    elif args.action == "downgrade":
        migrate.downgrade(url, revision=args.revision or "base")
        print(f"database schema downgraded to {args.revision or 'base'}")
    else:
        migrate.current(url)
    return 0


def _services(args: argparse.Namespace, ctx: Context) -> int:
    s = ctx.settings
    home = s.home
    if args.action == "stop":
        stopped = embedded.stop(home)
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    elif args.action == "start":
        urls = ServiceUrls.resolve(s)
        print(f"postgres: {urls.database}")
        print(f"redis:    {urls.redis}")
    else:
        for name, state in embedded.status(home).items():
            print(f"{name}: {state}")
        if s.database_url or s.redis_url:
            print("note: DATABASE_URL/REDIS_URL are set; the embedded servers are not used")
    return 0


def _submit(args: argparse.Namespace, ctx: Context) -> int:
    from payment_worker.producer.submit import cli_submit

    return cli_submit(args.file, ctx.runtime)


def _status(args: argparse.Namespace, ctx: Context) -> int:
    from payment_worker.producer.status import cli_status

    if not args.batch_ids and not args.all:
        print("payment-worker status: name one or more BATCH_IDs, or --all", file=sys.stderr)
        return 2
    return cli_status(args.batch_ids, ctx.runtime(), all_batches=args.all, as_json=args.json)


def _gateway_sim(argv: list[str]) -> int:
    from payment_worker.dev.simulator import main as sim_main

    return sim_main(argv)


def _demo(args: argparse.Namespace, ctx: Context) -> int:
    from payment_worker.dev.demo import run_demo

    return run_demo(ctx.runtime(), args.file, workers=args.workers, timeout=args.timeout)


def _sweep(_: argparse.Namespace, ctx: Context) -> int:
    from payment_worker.worker.sweeper import run_sweep

    print(json.dumps(run_sweep(ctx.runtime())))
    return 0


def _exporter(args: argparse.Namespace, ctx: Context) -> int:
    from payment_worker.ops.exporter import serve

    port = args.port if args.port is not None else ctx.settings.exporter_port
    serve(port, ctx.runtime().engine, host=args.host)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``payment-worker``."""
    p = argparse.ArgumentParser(prog="payment-worker", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    db = sub.add_parser("db", help="database schema (alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?")
    db.set_defaults(func=_db)

    sv = sub.add_parser("services", help="the embedded PostgreSQL and Redis")
    sv.add_argument("action", choices=["start", "stop", "status"])
    sv.set_defaults(func=_services)

    sm = sub.add_parser("submit", help="submit batches from a JSON file ('-' for stdin)")
    sm.add_argument("file")
    sm.set_defaults(func=_submit)

    st = sub.add_parser("status", help="status of batches")
    st.add_argument("batch_ids", nargs="*", metavar="BATCH_ID")
    st.add_argument("--all", action="store_true", help="every batch")
    st.add_argument("--json", action="store_true", help="a JSON array instead of a table")
    st.set_defaults(func=_status)

    sub.add_parser("gateway-sim", help="run the gateway simulator (see --help)", add_help=False)

    dm = sub.add_parser("demo", help="start a worker and beat, process a sample batch file")
    dm.add_argument("file", nargs="?", default=None)
    dm.add_argument("--workers", type=int, default=1)
    dm.add_argument("--timeout", type=float, default=180.0)
    dm.set_defaults(func=_demo)

    sw = sub.add_parser("sweep", help="run one sweeper pass now")
    sw.set_defaults(func=_sweep)

    ex = sub.add_parser("exporter", help="serve Postgres state gauges on EXPORTER_PORT /metrics")
    ex.add_argument("--host", default="0.0.0.0")
    ex.add_argument("--port", type=int, default=None, help="default: EXPORTER_PORT")
    ex.set_defaults(func=_exporter)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``payment-worker`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list[:1] == ["gateway-sim"]:
            return _gateway_sim(args_list[1:])
        args = build_parser().parse_args(args_list)
        s = load_settings()  # a bad setting fails here, with one line and exit code 2
        if not (args.command == "services" and args.action in ("status", "stop")):
            # no URL and no embedded extra: one line, exit code 2, before anything else
            missing = embedded.missing_for(s.database_url, s.redis_url)
            if missing:
                raise embedded.EmbeddedNotInstalled(missing)
        from payment_worker.ops.logging import configure_logging

        # logs go to stderr, so a command's own output (JSON lines, tables) stays clean
        configure_logging(s.log_level, s.log_json)
        try:
            rc: int = args.func(args, Context(s))
        finally:
            runtime.reset()
        return rc
    except SettingsError as exc:
        return int(exc.code or 2)
    except embedded.EmbeddedError as exc:
        # a missing extra, an OS user that cannot be created...: the set-up, not a bug
        print(f"payment-worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
