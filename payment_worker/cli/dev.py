"""``payment-worker demo`` and ``payment-worker gateway-sim``: the development tools.

The command line is the one place that wires ``payment_worker.dev`` to the runtime; these
imports stay inside the functions so that no other command loads the dev tools.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from payment_worker.cli.common import Context


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is less than 1")
    return value


def demo(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker demo [FILE] [--chaos] ...``: see :mod:`payment_worker.dev.demo`."""
    from payment_worker.dev.demo import DemoOptions, run_demo
    from payment_worker.dev.demo_workload import batches_from_file

    if args.file is not None:
        try:  # a bad file is one line and exit code 2, before anything starts
            batches_from_file(Path(args.file), "check")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"payment-worker demo: cannot use {args.file}: {exc}", file=sys.stderr)
            return 2
    opts = DemoOptions(
        file=args.file,
        accounts=args.accounts,
        items=args.items,
        workers=args.workers,
        concurrency=args.concurrency,
        chaos=args.chaos,
        timeout=args.timeout,
        json_report=args.json_report,
        keep_services=args.keep_services,
        seed=args.seed,
    )
    return run_demo(ctx.settings, ctx.runtime, opts)


def gateway_sim(argv: list[str]) -> int:
    """``payment-worker gateway-sim ...``: the simulator, which parses its own arguments."""
    from payment_worker.dev.simulator import main as sim_main

    return sim_main(argv)
