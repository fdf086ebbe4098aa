"""What every command shares: its :class:`Context`, and how a run ends (exit codes, clean-up)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from psycopg import errors as pg_errors
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from payment_worker import embedded, runtime
from payment_worker.db.retry import short_error
from payment_worker.ops.redaction import redact
from payment_worker.runtime import Runtime
from payment_worker.settings import Settings, SettingsError


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


Command = Callable[[argparse.Namespace, Context], int]
"""The body of one command: its parsed arguments and context in, its exit code out."""


def run_command(command: Command, args: argparse.Namespace, settings: Settings) -> int:
    """Run ``command`` with logs on stderr, then release this process's runtime."""
    from payment_worker.ops.logging import configure_from_settings

    # logs go to stderr, so a command's own output (JSON lines, tables) stays clean
    configure_from_settings(settings)
    stop_on_sigint()
    try:
        return command(args, Context(settings))
    finally:
        runtime.reset()


def stop_on_sigint() -> None:
    """Let SIGINT (Ctrl-C) stop the command even when it was started with SIGINT ignored:
    a background job of a shell without job control inherits that (a CI runner's, a
    script's), and Python then never installs its handler, so ``kill -INT`` did nothing to
    ``payment-worker demo`` or ``exporter`` there. A terminal's Ctrl-C reaches only the
    foreground job anyway."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)


# a statement naming what the schema does not have: the database was never migrated, or
# is behind this code
_SCHEMA_BEHIND = (pg_errors.UndefinedTable, pg_errors.UndefinedColumn, pg_errors.UndefinedFunction)


def database_error(exc: BaseException) -> str:
    """A database error in one line for a person: its first line only (SQLAlchemy's text
    goes on with the statement and its parameters, a batch's beneficiaries among them), URL
    passwords and account numbers masked, and what to do when the schema is missing."""
    line = f"database error: {redact(short_error(exc))}"
    if isinstance(getattr(exc, "orig", None) or exc, _SCHEMA_BEHIND):
        line += " (the schema is missing or older than this code: run `payment-worker db upgrade`)"
    return line


def guarded(body: Callable[[], int]) -> int:
    """Run ``body`` and turn the failures of the set-up into exit codes, without a traceback:
    a bad setting or an embedded-server problem is one line and 2, an unreachable or
    refusing database or Redis one line and 1, Ctrl-C 130."""
    try:
        return body()
    except SettingsError as exc:
        return int(exc.code or 2)
    except embedded.EmbeddedError as exc:
        # a missing extra, an OS user that cannot be created...: the set-up, not a bug
        print(f"payment-worker: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        # the commands that can stop half-way say what they did before this line
        print(f"payment-worker: {database_error(exc)}", file=sys.stderr)
        return 1
    except RedisError as exc:
        print(f"payment-worker: Redis error: {redact(short_error(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader of the output went away (``| head``): one line, not a traceback, and
        # stdout pointed at /dev/null so that Python's exit-time flush cannot raise again
        closed_output()
        print("payment-worker: the output was closed; stopped", file=sys.stderr)
        return 1


def json_text(value: object, out: TextIO | None = None, default: Any = None) -> str:
    """``value`` as JSON for ``out`` (stdout by default): its text as is where ``out`` takes
    UTF-8, escaped (``\\u8d26``, the same JSON value) where it does not, so that a batch id
    in another script never ends a command with a traceback after its batch was saved."""
    stream = sys.stdout if out is None else out
    encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
    return json.dumps(value, ensure_ascii=encoding != "utf8", default=default)


def closed_output() -> None:
    """Point stdout at /dev/null after a ``BrokenPipeError`` (its reader went away)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
