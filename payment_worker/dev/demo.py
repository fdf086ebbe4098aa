"""``payment-worker demo``: the service end to end on this machine, faults included.

Starts (or reuses) PostgreSQL and Redis (the embedded ones, or the servers of the URLs),
migrates the schema, starts the gateway simulator with faults switched on, the exporter and
a few Celery workers, submits a few hundred items over several accounts plus two submissions
that must be refused, shows progress until every item is final, and reports what happened,
checked against the simulator's ledger (double payments must be 0). ``--chaos`` also kills
and pauses workers that hold account locks.

Only the demo's own lines reach the terminal: every process it starts logs to a file of the
run folder (``PAYMENT_WORKER_HOME/demo/RUN_ID``), and so does this process (its stderr is
redirected there while the demo runs). Everything it starts is stopped at the end, on
Ctrl-C and on SIGTERM alike, by process group.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from payment_worker import embedded
from payment_worker.db import migrate, reports
from payment_worker.db.retry import short_error
from payment_worker.dev import demo_workload as workload
from payment_worker.dev.demo_chaos import Chaos
from payment_worker.dev.demo_report import WorkerMetrics, build_report, render
from payment_worker.dev.local_cluster import LocalCluster, ManagedProcess, free_port
from payment_worker.dev.reconcile import reconcile
from payment_worker.domain.statuses import TERMINAL_TX_STATUSES
from payment_worker.ops.redaction import redact
from payment_worker.runtime import Runtime
from payment_worker.settings import Settings

# the demo's workers: a short lock TTL (so a pause outlives it within seconds) and short
# backoffs, so every fault is repaired within the run (the sweeper's defaults are fast
# already). Set for the processes the demo starts only.
LOCK_TTL_MS = 3000
WORKER_ENV = {
    "LOCK_TTL_MS": str(LOCK_TTL_MS),
    "LOCK_SAFETY_MARGIN_MS": "500",
    "GATEWAY_READ_TIMEOUT": "1.0",
    "GATEWAY_RATE_PER_SECOND": str(workload.SIM_RATE),
    "RETRY_BASE_DELAY": "0.2",
    "RETRY_MAX_DELAY": "2",
    "RETRY_MAX_ATTEMPTS": "15",
    "LOOKUP_MAX_DELAY": "2",
}
# set in every process the demo starts: `grep -l PW_DEMO_RUN=<run> /proc/*/environ` finds them
RUN_MARKER = "PW_DEMO_RUN"
_OPEN_ORDER = ("pending", "dispatching", "retryable", "unknown")


@dataclass
class DemoOptions:
    """The demo's flags."""

    file: str | None = None
    accounts: int = 6
    items: int = 360
    workers: int = 3
    concurrency: int = 8
    chaos: bool = False
    timeout: float = 90.0
    json_report: str | None = None
    keep_services: bool = False
    seed: int = 7


_SERVER_NAMES = {"postgres": "PostgreSQL", "redis": "Redis"}


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM or SIGHUP, handled like Ctrl-C: stop everything, then exit 130
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[IO[str]]:
    """Send this process's fd 2 (logging, alembic, structlog, C libraries) to ``path``;
    yields a stream on the real stderr for the demo's own error lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    real = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield real
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        real.close()


def _group_alive(pgid: int) -> bool:
    """Whether any process is in process group ``pgid`` (from /proc; no signal sent)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def marked(run_id: str) -> list[int]:
    """Pids of the live processes started by the demo run ``run_id`` (their environment holds
    the run marker), from /proc; empty where there is no /proc."""
    needle = f"{RUN_MARKER}={run_id}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError, ValueError):
            if needle in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
    return found


def kill_marked(run_id: str) -> None:
    """The last safety net: SIGKILL whatever of the run still lives (normally nothing)."""
    for pid in marked(run_id):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def _log(text: str) -> None:
    """A line in demo.log (this process's stderr while the demo runs)."""
    print(f"{time.strftime('%H:%M:%S')} demo: {text}", file=sys.stderr, flush=True)


def stop_all(processes: list[ManagedProcess], timeout: float = 10.0) -> None:
    """SIGTERM every process group at once, SIGKILL what is left after ``timeout``, then
    make sure no member of any group survives its leader."""
    _log("stopping " + ", ".join(p.name for p in processes if p.alive()))
    started = time.monotonic()
    for p in processes:
        p.signal(signal.SIGCONT)
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in processes:
        if p.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in processes:
        if p.alive():
            _log(f"{p.name} still running {timeout:g} s after SIGTERM: SIGKILL")
            p.kill()
        if p.popen is not None and _group_alive(p.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        p.stop(timeout=1.0)  # closes its log file
    _log(f"stopped in {time.monotonic() - started:.1f} s")


def _sayer(console: Console) -> Callable[[str], None]:
    """The demo's own lines: never wrapped (a long id stays greppable in a log or a pipe)."""

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, highlight=False)

    return say


def _counts_line(counts: dict[str, int]) -> str:
    final = " · ".join(f"{s} {counts.get(s, 0)}" for s in ("succeeded", "failed", "dead"))
    open_ = " ".join(f"{s} {counts[s]}" for s in _OPEN_ORDER if counts.get(s))
    return final + (f"  │ open: {open_}" if open_ else "")


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd()))
    return str(path)


def run_demo(settings: Settings, runtime: Callable[[], Runtime], opts: DemoOptions) -> int:
    """Run the demo; returns the exit code (0: everything final, 0 double payments, nothing
    lost). ``runtime`` is a callable that builds this process's Runtime (it may start the
    embedded servers, so it is called once stderr goes to the run folder)."""
    s = settings
    run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
    run_dir = (s.home / "demo" / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # a pipe or a CI log has no width: wide enough for the report's table
    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 110)
    old = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with _stderr_to(run_dir / "demo.log") as real_stderr:
            try:
                return _run(s, runtime, opts, run_id, run_dir, console)
            except KeyboardInterrupt:
                console.print("\ninterrupted: stopping everything the demo started", soft_wrap=True)
                raise
            except Exception as exc:  # one clear line on the terminal; the details in the log
                import traceback

                traceback.print_exc()  # to demo.log
                # its first line (a database error's text goes on with the statement)
                print(
                    f"payment-worker demo: {redact(short_error(exc))} (details in {run_dir})",
                    file=real_stderr,
                )
                return 1
    finally:
        # a second Ctrl-C must not cut the clean-up short
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        kill_marked(run_id)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(
    s: Settings,
    make_runtime: Callable[[], Runtime],
    opts: DemoOptions,
    run_id: str,
    run_dir: Path,
    console: Console,
) -> int:
    say = _sayer(console)
    say(f"[bold]payment-worker demo[/bold]{' --chaos' if opts.chaos else ''}  (run {run_id})")
    say(f"  files    {_rel(run_dir)}/  (a .log per process, the batches, the report)")
    embedded_mode = not (s.database_url and s.redis_url)
    # the embedded servers this run uses, and of those the ones it starts: only these are
    # stopped at its end (a server already running, or one named by a URL, is left alone)
    ours = [name for name, url in (("postgres", s.database_url), ("redis", s.redis_url)) if not url]
    before = embedded.status(s.home) if ours else {}
    started_now = [name for name in ours if not before[name].startswith("running")]
    started_services = bool(started_now)
    rt: Runtime | None = None
    try:
        # (inside: a server started before the other failed to start is stopped again)
        rt = make_runtime()
        if embedded_mode:
            how = "started now" if started_services else "already running"
            what = " + ".join(_SERVER_NAMES[name] for name in ours)
            say(f"  servers  embedded {what} under {_rel(s.home)} ({how})")
        else:
            say("  servers  yours, from DATABASE_URL / REDIS_URL: the demo adds batches of")
            say("           demo-* accounts and publishes to the broker's payments queue; it")
            say("           flushes nothing")
        migrate.upgrade(rt.urls.sqlalchemy)
        say("  schema   at head (alembic upgrade head)")
        return _with_cluster(s, rt, opts, run_id, run_dir, console)
    finally:
        if rt is not None:
            rt.close()
        if started_services and not opts.keep_services:
            embedded.stop(s.home, only=started_now)
            what = " + ".join(_SERVER_NAMES[name] for name in started_now)
            them = "it" if len(started_now) == 1 else "them"
            say(f"  embedded {what} stopped (not running before; any command starts {them} again)")


def _with_cluster(
    s: Settings, rt: Runtime, opts: DemoOptions, run_id: str, run_dir: Path, console: Console
) -> int:
    say = _sayer(console)
    env = {
        **os.environ,
        **WORKER_ENV,
        "DATABASE_URL": rt.urls.database,
        "REDIS_URL": rt.urls.redis,
        "CELERY_BROKER_URL": rt.urls.broker,
        "PAYMENT_WORKER_HOME": str(s.home.resolve()),
        RUN_MARKER: run_id,
    }
    if opts.file:
        batches = workload.batches_from_file(Path(opts.file), run_id)
    else:
        batches = workload.synthetic_batches(run_id, accounts=opts.accounts, items=opts.items)
    accounts = sorted({str(b["account_id"]) for b in batches})
    total = sum(len(b["items"]) for b in batches)
    metrics = WorkerMetrics()
    cluster = LocalCluster(workdir=run_dir, env=env, concurrency=opts.concurrency)
    chaos: Chaos | None = None
    try:
        sim = cluster.start_simulator(rate=workload.SIM_RATE, seed=opts.seed, **workload.SIM_FAULTS)
        workload.script_faults(sim, accounts)
        say(
            f"  gateway  simulator at {sim}, {workload.SIM_RATE:g} requests/s per account: "
            f"{workload.describe_faults()}"
        )
        exporter_port = free_port()
        exporter = ManagedProcess(
            "exporter",
            [
                sys.executable,
                "-m",
                "payment_worker.cli",
                "exporter",
                "--host",
                "127.0.0.1",
                "--port",
                str(exporter_port),
            ],
            dict(cluster.env),
            run_dir / "exporter.log",
        )
        cluster.processes.append(exporter.start())
        exporter_url = f"http://127.0.0.1:{exporter_port}/metrics"

        def start_worker() -> ManagedProcess:
            port = free_port()
            cluster.env["METRICS_PORT"] = str(port)
            p = cluster.start_worker()
            metrics.watch(p.name, f"http://127.0.0.1:{port}/metrics")
            return p

        for _ in range(opts.workers):
            start_worker()
        say(
            f"  workers  {opts.workers} x celery -A payment_worker worker "
            f"(-P {cluster.pool} -c {opts.concurrency}), lock TTL {LOCK_TTL_MS / 1000:g} s"
        )
        say(f"  metrics  {exporter_url} (the exporter, while the demo runs)")

        workload.write_jsonl(run_dir / "batches.jsonl", batches)
        t0 = time.monotonic()
        answers = workload.submit_all(batches, rt)
        ids = [a.batch_id for a in answers if a.status == "accepted"]
        if len(ids) != len(batches):
            bad = [
                f"{a.batch_id}: {a.status} {a.reason()}" for a in answers if a.status != "accepted"
            ]
            raise RuntimeError("the demo's batches were not all accepted: " + "; ".join(bad))
        say(f"  submit   {len(ids)} batches, {total} items over {len(accounts)} accounts: accepted")
        again = workload.refused_batches(batches, run_id)
        workload.write_jsonl(run_dir / "refused.jsonl", again)
        refused = workload.submit_all(again, rt)
        for a in refused:
            say(f"  refused  {a.status:<9} {a.batch_id}: {a.reason()}")

        done_now = [0]
        printed = [0]  # chaos events already shown
        if opts.chaos:
            chaos = Chaos(
                redis_client=rt.redis,
                keys=rt.keys,
                accounts=accounts,
                lock_ttl_ms=LOCK_TTL_MS,
                workers=cluster.workers,
                start_worker=start_worker,
                started=lambda: done_now[0] > 0,
                work_left=lambda: done_now[0] < total,
                seed=opts.seed,
            )
            chaos.start()
        counts = _follow(rt, ids, total, opts.timeout, console, metrics, done_now, chaos, printed)
        elapsed = time.monotonic() - t0
        events: list[str] = []
        if chaos is not None:
            chaos.stop()
            events = chaos.events
        metrics.refresh()
        # the workers stop before the ledger is read: a late payment during shutdown shows
        stop_all([p for p in cluster.processes if p.name != "gateway-sim"])
        ledger = cluster.ledger()
        with rt.engine.connect() as conn:
            rec = reconcile(conn, ledger, ids)
            summary = reports.run_summary(conn, ids)
    finally:
        try:
            if chaos is not None:
                chaos.stop()
        finally:
            stop_all(cluster.processes)
    for e in events[printed[0] :]:
        say(f"  chaos: {e}")
    report = build_report(
        head={
            "run_id": run_id,
            "run_dir": str(run_dir),
            "chaos": opts.chaos,
            "items": total,
            "batch_ids": ids,
            "elapsed_seconds": elapsed,
            "chaos_events": events,
            "exporter_url": exporter_url,
            "next_steps": _next_steps(s, ids, run_dir),
        },
        summary=summary,
        rec=rec,
        ledger=ledger,
        metrics=metrics,
        refused=refused,
        accounts=accounts,
    )
    say("")
    render(report, console)
    report.write_json(run_dir / "report.json")
    if opts.json_report:
        report.write_json(Path(opts.json_report))
    final = sum(counts.get(st, 0) for st in TERMINAL_TX_STATUSES)
    if report.ok and final >= total:
        say(
            "\n[green]every item is final; none was paid twice; "
            "Postgres agrees with the gateway[/green]"
        )
        return 0
    say(f"\n[red]demo failed[/red]: see the report above and the logs in {_rel(run_dir)}")
    return 1


def _follow(
    rt: Runtime,
    ids: list[str],
    total: int,
    timeout: float,
    console: Console,
    metrics: WorkerMetrics,
    done_now: list[int],
    chaos: Chaos | None,
    printed: list[int],
) -> dict[str, int]:
    """Show progress until every item is final or ``timeout`` passes; the last counts.

    On a terminal, a live bar; otherwise (CI, a pipe) one plain line every 5 s.
    """
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    live = console.is_terminal
    progress = Progress(
        TextColumn("  processing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        disable=not live,
    )
    last_line, last_text = 0.0, ""  # off a terminal: a line every 5 s, when it changed
    with progress:
        task = progress.add_task("", total=total)
        while True:
            with rt.engine.connect() as conn:
                counts = reports.transaction_counts(conn, ids)
            done = sum(counts.get(st, 0) for st in TERMINAL_TX_STATUSES)
            done_now[0] = done
            metrics.refresh()
            if live:
                progress.update(task, completed=done, description=_counts_line(counts))
            now = time.monotonic()
            # with --chaos, the kill and the pause run to their end before the report
            busy = chaos is not None and chaos.is_alive()
            finished = (done >= total and not busy) or now >= deadline
            if chaos is not None:
                for e in chaos.events[printed[0] :]:
                    console.print(f"  chaos: {e}", highlight=False, soft_wrap=True)
                printed[0] = len(chaos.events)
            line = f"  {done}/{total} final  {_counts_line(counts)}"
            if not live and line != last_text and (finished or now - last_line >= 5.0):
                console.print(line, highlight=False, soft_wrap=True)
                last_line, last_text = now, line
            if finished:
                return counts
            time.sleep(0.5)


def _command(name: str) -> str:
    """How to call one of this install's commands from the current directory: by name when
    the shell finds this install's script, else by its path (``.venv/bin/...`` after ``make
    demo``, whose shell has no activated venv)."""
    script = Path(sys.executable).parent / name
    found = shutil.which(name)
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return name
    return _rel(script)  # a path with a slash: the shell runs it as it is


def _next_steps(s: Settings, ids: list[str], run_dir: Path) -> list[str]:
    urls = "" if not (s.database_url and s.redis_url) else "  (with the same URLs set)"
    pw, celery = _command("payment-worker"), _command("celery")
    return [
        f"{pw} status {ids[0]}    # one batch, item by item{urls}",
        f"{celery} -A payment_worker dlq list    # dead letters, if any, and what to do with them",
        f"{pw} exporter    # then http://127.0.0.1:{s.exporter_port}/metrics",
        f"less {_rel(run_dir)}/worker1.log    # what a worker logged",
        "docs/quickstart.md, docs/runbook.md, docs/architecture.md",
    ]
