"""Phase stamps in the workers, for ``bench/phases.py`` (a diagnostic, never the service's).

On ``PYTHONPATH`` this module is imported at every interpreter start; it acts only in a
process whose command line names ``worker`` and with ``PW_PHASES_DIR`` set. There it wraps,
as each module is imported, the drain's entry and exit, the lock's acquire, the first claim
and every gateway send, and appends one line per event to ``$PW_PHASES_DIR/ev-<pid>.log``:
``<unix time> <event> <account>``. It patches internals by name: a renamed function makes it
stamp nothing (``bench/phases.py`` then says so), never break a worker.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_DIR = os.environ.get("PW_PHASES_DIR")


def _install() -> None:
    out = open(os.path.join(_DIR or ".", f"ev-{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115

    def stamp(event: str, account: object) -> None:
        out.write(f"{time.time():.5f} {event} {account}\n")

    def around(owner: Any, name: str, begin: str, finish: str) -> None:
        """Stamp ``begin`` and ``finish`` around a method whose first argument is the account."""
        method = getattr(owner, name)

        def wrapped(self: Any, account_id: str, *a: Any, **k: Any) -> Any:
            stamp(begin, account_id)
            try:
                return method(self, account_id, *a, **k)
            finally:
                stamp(finish, account_id)

        setattr(owner, name, wrapped)

    def drain(mod: ModuleType) -> None:
        around(mod.Drainer, "run_account", "task", "end")

    def lock(mod: ModuleType) -> None:
        acquire = mod.AccountLock.acquire

        def wrapped(self: Any, *a: Any, **k: Any) -> Any:
            taken = acquire(self, *a, **k)
            stamp("locked" if taken else "busy", self.account_id)
            return taken

        mod.AccountLock.acquire = wrapped

    def work(mod: ModuleType) -> None:
        around(mod.PgWorkStore, "fence_and_claim", "claim", "claimed")

    def client(mod: ModuleType) -> None:
        from structlog.contextvars import get_contextvars

        send = mod.GatewayClient._send

        def wrapped(self: Any, endpoint: str, *a: Any, **k: Any) -> Any:
            account = get_contextvars().get("account_id", "-")
            stamp(f"{endpoint}_sent", account)
            try:
                return send(self, endpoint, *a, **k)
            finally:
                stamp(f"{endpoint}_answered", account)

        mod.GatewayClient._send = wrapped

    patches: dict[str, Callable[[ModuleType], None]] = {
        "payment_worker.worker.drain": drain,
        "payment_worker.locks.account_lock": lock,
        "payment_worker.db.work_store": work,
        "payment_worker.gateway.client": client,
    }

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(
            self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
        ) -> importlib.machinery.ModuleSpec | None:
            patch = patches.get(name)
            if patch is None:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                try:
                    patch(module)
                except AttributeError as exc:
                    stamp(f"unpatched:{name}:{exc}".replace(" ", "_"), "-")

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())


if _DIR and "worker" in sys.argv:
    _install()
