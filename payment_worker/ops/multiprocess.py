"""prometheus-client's multiprocess mode for Celery workers, switched on before its import.

A Celery worker's metrics must be right with every pool: with prefork the tasks run in
forked children, whose counters the parent's registry never sees. prometheus-client's
multiprocess mode has each process write its values to files in one directory, and the
process that serves ``/metrics`` merges them. The mode is chosen when
``prometheus_client`` is first imported (``PROMETHEUS_MULTIPROC_DIR`` in the environment),
so :func:`prepare_worker` runs when the ``payment_worker`` package is first imported: in
``celery -A payment_worker worker`` that is before anything imports ``prometheus_client``
(Celery loads our ``celery.commands`` plugin, then the app), and the parent sets the
variable before it forks a child. It acts only in the main process of ``celery ...
worker`` (read from its command line), and only once, and only when the worker's pool
forks (prefork): a threads or solo worker is one process, whose own registry is already
complete. The mode would cost it dearly: prometheus-client's multiprocess values share one
lock per process ("no threading going on"), and with hundreds of task threads that lock
was 74 % of the busy samples of a worker in issue 13's scenario 5 (a thread holding it
waits for the GIL behind every other). Other processes (CLI, beat, exporter) keep the plain
in-process registry too.

This module must not import ``prometheus_client`` at module level.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"
# set in a worker's environment by prepare_worker when it made the directory itself, so that
# the worker removes it at shutdown (a directory the operator named is only emptied)
_OWNED_ENV = "PAYMENT_WORKER_METRICS_DIR_OWNED"


# the options of the `celery` command itself that take a value (celery/bin/celery.py)
_CELERY_VALUE_OPTIONS = (
    "-A",
    "--app",
    "-b",
    "--broker",
    "--result-backend",
    "--loader",
    "--config",
    "--workdir",
)


def celery_subcommand(argv: list[str]) -> str | None:
    """The sub-command of a ``celery`` command line (``worker``, ``beat``...), or None when
    ``argv`` is not Celery's command line."""
    if not argv:
        return None
    prog = Path(argv[0])
    if prog.name != "celery" and not (prog.name == "__main__.py" and prog.parent.name == "celery"):
        return None
    args = iter(argv[1:])
    for arg in args:
        if arg in _CELERY_VALUE_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def pool_on_command_line(argv: list[str]) -> str | None:
    """The pool a ``celery ... worker`` command line names with ``-P``/``--pool``, or None.

    Celery cannot tell ``-P prefork`` (its option's default value) from no option once a
    pool is configured (``WorkersPool.convert`` in celery/bin/worker.py): without this, an
    explicit ``-P prefork`` would silently run WORKER_POOL's pool instead.
    """
    return _worker_option(argv, "-P", "--pool")


def concurrency_on_command_line(argv: list[str]) -> int | None:
    """The slots a ``celery ... worker`` command line asks for with ``-c``/``--concurrency``
    (it wins over ``worker_concurrency``), or None (none given, or not a number)."""
    found = _worker_option(argv, "-c", "--concurrency")
    try:
        return int(found) if found is not None else None
    except ValueError:
        return None  # Celery itself refuses it


def _worker_option(argv: list[str], short: str, long: str) -> str | None:
    """The last value given to a ``celery ... worker`` option (``-X v``, ``-Xv``, ``--x v``,
    ``--x=v``), or None."""
    if celery_subcommand(argv) != "worker":
        return None
    found = None
    args = iter(argv[1:])
    for arg in args:
        if arg in (short, long):
            found = next(args, None)
        elif arg.startswith(long + "="):
            found = arg.split("=", 1)[1]
        elif arg.startswith(short) and len(arg) > 2:
            found = arg[2:]
    return found


# pools that run every task in the worker's own process: one registry sees every count
SINGLE_PROCESS_POOLS = ("threads", "solo")


def worker_pool(argv: list[str], environ: Mapping[str, str]) -> str:
    """The pool a worker with this command line and environment runs: ``-P`` on the command
    line, else ``WORKER_POOL`` (read as the settings read it: any case, trimmed), else the
    settings' default, threads. Read here, before the settings can be loaded (this runs at
    the package's first import); a value the settings refuse stops the worker later."""
    named = pool_on_command_line(argv)
    if named is None:
        named = next((v for k, v in environ.items() if k.lower() == "worker_pool"), "threads")
    return named.strip().lower()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _base_dir() -> Path:
    # per OS user, under TMPDIR (point TMPDIR at a tmpfs for speed)
    return Path(tempfile.gettempdir()) / f"payment-worker-metrics-{os.getuid()}"


def _remove_stale(base: Path) -> None:
    """Directories left by workers that were killed (named by their pid)."""
    for entry in base.iterdir():
        if entry.is_dir() and entry.name.isdigit() and not pid_alive(int(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)


def wipe(path: Path) -> None:
    """Remove every metric file in ``path``: values of an earlier run must not be summed in."""
    for f in path.glob("*.db"):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()


def prepare_worker() -> Path | None:
    """In a Celery worker's main process, before ``prometheus_client`` is imported: point
    ``PROMETHEUS_MULTIPROC_DIR`` at an empty directory of this worker. Does nothing in any
    other process; returns the directory when it set one up.

    An operator's ``PROMETHEUS_MULTIPROC_DIR`` is used as given (one directory per worker
    instance on a host: it is emptied at start); otherwise the worker makes
    ``$TMPDIR/payment-worker-metrics-<uid>/<pid>`` and removes it when it stops (also when
    it was started detached: the directory its first process made is not taken for one an
    operator gave).
    """
    if celery_subcommand(sys.argv) != "worker":
        return None
    if worker_pool(sys.argv, os.environ) in SINGLE_PROCESS_POOLS:
        return None
    if "prometheus_client.values" in sys.modules and not os.environ.get(ENV):
        # the mode is fixed at import: something imported prometheus_client first
        print(
            "payment-worker: prometheus_client was imported before the worker could switch on "
            f"its multiprocess mode; set {ENV} to an empty directory for this worker",
            file=sys.stderr,
        )
        raise SystemExit(1)
    given = os.environ.get(ENV)
    # a directory an earlier process of this worker made (``--detach`` and ``celery multi``
    # fork and exec the worker again with the same environment): named after that process,
    # which is gone, so any worker's start would delete it as stale under this one. This
    # process makes its own instead
    inherited = bool(given) and os.environ.get(_OWNED_ENV) == given
    if given and not inherited:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        os.environ.pop(_OWNED_ENV, None)
    else:
        base = _base_dir()
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_stale(base)
        path = base / str(os.getpid())
        path.mkdir(mode=0o700, exist_ok=True)
        os.environ[ENV] = str(path)
        os.environ[_OWNED_ENV] = str(path)
        # also when the worker ends before its shutdown signal (a bad setting at start)
        atexit.register(remove_owned_dir)
    wipe(path)
    return path


def _pid_of(path: Path) -> int | None:
    pid = path.stem.rpartition("_")[2]
    return int(pid) if pid.isdigit() else None


def compact_dead(path: Path) -> int:
    """Fold the counter and histogram files of processes that have ended into one archive
    file per type, so that a worker recycling its pool children (worker_max_tasks_per_child)
    does not make every scrape read a file per child that ever lived. Their counts stay in
    the sums. Only the process that serves ``/metrics`` calls it, one call at a time.
    Returns how many files were folded."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key
    from prometheus_client.multiprocess import MultiProcessCollector

    me = os.getpid()
    folded = 0
    for typ in ("counter", "histogram"):
        dead = [
            f
            for f in path.glob(f"{typ}_*.db")
            if (pid := _pid_of(f)) is not None and pid != me and not pid_alive(pid)
        ]
        if not dead:
            continue
        archive = path / f"{typ}_archive.db"
        inputs = [archive, *dead] if archive.exists() else dead
        # not cumulated: histogram buckets are stored per bucket, as each process writes them
        merged = MultiProcessCollector.merge(  # type: ignore[no-untyped-call]
            [str(f) for f in inputs], accumulate=False
        )
        tmp = path / f"{typ}_archive.tmp"  # not *.db: a scrape never reads it half written
        tmp.unlink(missing_ok=True)
        out = MmapedDict(str(tmp))  # type: ignore[no-untyped-call]
        try:
            for metric in merged:
                for sample in metric.samples:
                    key = mmap_key(
                        metric.name,
                        sample.name,
                        list(sample.labels),
                        list(sample.labels.values()),
                        metric.documentation,
                    )
                    out.write_value(key, sample.value, 0.0)  # type: ignore[no-untyped-call]
        finally:
            out.close()  # type: ignore[no-untyped-call]
        os.replace(tmp, archive)
        for f in dead:
            f.unlink(missing_ok=True)
        folded += len(dead)
    return folded


def enabled() -> bool:
    """Whether this process writes its metrics in multiprocess mode."""
    return bool(os.environ.get(ENV))


def remove_owned_dir() -> None:
    """At the worker's shutdown: remove the directory :func:`prepare_worker` made (only in
    the process that made it, never in a pool child)."""
    owned = os.environ.get(_OWNED_ENV)
    if owned and os.environ.get(ENV) == owned and Path(owned).name == str(os.getpid()):
        shutil.rmtree(owned, ignore_errors=True)
