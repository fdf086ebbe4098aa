"""``payment-worker demo`` and ``payment-worker gateway-sim``: the development tools.

The command line is the one place that wires ``payment_worker.dev`` to the runtime; these
imports stay inside the functions so that no other command loads the dev tools.
"""

from __future__ import annotations

import argparse

from payment_worker.cli.common import Context


def demo(args: argparse.Namespace, ctx: Context) -> int:
    """``payment-worker demo [FILE]``: a worker and beat processing a sample batch file."""
    from payment_worker.dev.demo import run_demo

    return run_demo(ctx.runtime(), args.file, workers=args.workers, timeout=args.timeout)


def gateway_sim(argv: list[str]) -> int:
    """``payment-worker gateway-sim ...``: the simulator, which parses its own arguments."""
    from payment_worker.dev.simulator import main as sim_main

    return sim_main(argv)
