"""The ``payment-worker`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from payment_worker import embedded
from payment_worker.cli import dev, ops, services, status, submit
from payment_worker.cli.common import guarded, run_command
from payment_worker.settings import load_settings

__all__ = ["build_parser", "main"]


def _port(text: str) -> int:
    """A TCP port to listen on, 1 to 65535 (argparse's one-line error otherwise)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, got {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``payment-worker``."""
    p = argparse.ArgumentParser(prog="payment-worker", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    db = sub.add_parser("db", help="database schema (alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?")
    db.set_defaults(func=services.db)

    sv = sub.add_parser("services", help="the embedded PostgreSQL and Redis")
    sv.add_argument("action", choices=["start", "stop", "status"])
    sv.set_defaults(func=services.services)

    sm = sub.add_parser("submit", help="submit batches from a JSON file ('-' for stdin)")
    sm.add_argument("file")
    sm.set_defaults(func=submit.submit)

    st = sub.add_parser("status", help="status of batches")
    st.add_argument("batch_ids", nargs="*", metavar="BATCH_ID")
    st.add_argument("--all", action="store_true", help="every batch")
    st.add_argument("--json", action="store_true", help="a JSON array instead of a table")
    st.set_defaults(func=status.status)

    sub.add_parser("gateway-sim", help="run the gateway simulator (see --help)", add_help=False)
    sub.add_parser(
        "dlq", help="dead letters: list, show, replay, resolve (see --help)", add_help=False
    )

    dm = sub.add_parser(
        "demo",
        help="the service end to end: workers, exporter, a faulty gateway simulator, a report",
        description="Runs a few hundred payments through real workers against the gateway "
        "simulator with faults on, then reports what happened (0 double payments).",
    )
    dm.add_argument("file", nargs="?", default=None, help="a batch file instead of synthetic ones")
    dm.add_argument("--accounts", type=dev.positive_int, default=6, help="default: 6")
    dm.add_argument("--items", type=dev.positive_int, default=360, help="default: 360")
    dm.add_argument("--workers", type=dev.positive_int, default=3, help="default: 3")
    dm.add_argument("--concurrency", type=dev.positive_int, default=8, help="threads per worker")
    dm.add_argument("--chaos", action="store_true", help="also kill and pause lock holders")
    dm.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the items")
    dm.add_argument("--json-report", metavar="PATH", help="also write the report as JSON")
    dm.add_argument(
        "--keep-services", action="store_true", help="leave embedded servers it started running"
    )
    dm.add_argument("--seed", type=int, default=7, help="the simulator's and chaos's seed")
    dm.set_defaults(func=dev.demo)

    sw = sub.add_parser("sweep", help="run one sweeper pass now")
    sw.set_defaults(func=ops.sweep)

    ex = sub.add_parser("exporter", help="serve Postgres state gauges on EXPORTER_PORT /metrics")
    ex.add_argument("--host", default="0.0.0.0")
    ex.add_argument("--port", type=_port, default=None, help="default: EXPORTER_PORT")
    ex.set_defaults(func=ops.exporter)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``payment-worker`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: _run(args_list))


def _run(args_list: list[str]) -> int:
    if args_list[:1] == ["gateway-sim"]:
        # its flags belong to the simulator's own parser, and it needs no settings
        return dev.gateway_sim(args_list[1:])
    if args_list[:1] == ["dlq"]:
        # a click group (also `celery -A payment_worker dlq`): it parses its own arguments
        from payment_worker.cli import dlq

        return dlq.main(args_list[1:])
    args = build_parser().parse_args(args_list)
    s = load_settings()  # a bad setting fails here, with one line and exit code 2
    if not (args.command == "services" and args.action in ("status", "stop")):
        # no URL and no embedded extra: one line, exit code 2, before anything else
        missing = embedded.missing_for(s.database_url, s.redis_url)
        if missing:
            raise embedded.EmbeddedNotInstalled(missing)
    return run_command(args.func, args, s)
