"""``python -m payment_worker.cli``: the same as the ``payment-worker`` command."""

import sys

from payment_worker.cli import main

# guarded: importing every module of the package (as a test does) must run nothing
if __name__ == "__main__":
    sys.exit(main())
