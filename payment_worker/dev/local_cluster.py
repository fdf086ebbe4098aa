"""A local cluster of real processes: the gateway simulator, Celery workers and beat.

Used by the demo, the end-to-end and chaos tests and the throughput benchmark: every
process is a real subprocess that can be killed, paused (SIGSTOP) and restarted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ManagedProcess:
    """One subprocess with its log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self) -> ManagedProcess:
        """Start the process, output appended to its log file."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        """The process id."""
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        """True while the process runs (or is paused)."""
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group (a worker and its children)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=30)

    def pause(self) -> None:
        """SIGSTOP: the process freezes, its lock renewals stop."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self.signal(signal.SIGCONT)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (warm shutdown), then SIGKILL if it does not exit in time."""
        if self.popen is not None and self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class LocalCluster:
    """Simulator + workers + beat on this machine, sharing one environment.

    ``pool``/``concurrency`` None: no ``-P``/``-c`` flag, the plain command (the settings'
    ``WORKER_POOL``/``WORKER_CONCURRENCY`` decide).
    """

    workdir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    concurrency: int | None = 8
    pool: str | None = "threads"
    processes: list[ManagedProcess] = field(default_factory=list)
    sim_url: str | None = None
    _counter: int = 0

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)

    def _proc(self, name: str, argv: list[str]) -> ManagedProcess:
        p = ManagedProcess(name, argv, dict(self.env), self.workdir / f"{name}.log")
        self.processes.append(p)
        return p

    # --- gateway simulator ------------------------------------------------------------
    def start_simulator(self, **flags: Any) -> str:
        """Start the simulator on a free port; sets GATEWAY_URL and GATEWAY_CLIENT_SECRET (the
        simulator's ``--secret``) for later processes."""
        port = free_port()
        secret = str(flags.pop("secret", None) or self.env.get("GATEWAY_CLIENT_SECRET") or "")
        flags["secret"] = secret or "sim-secret"
        argv = [sys.executable, "-m", "payment_worker.cli", "gateway-sim", "--port", str(port)]
        for key, value in flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        proc = self._proc("gateway-sim", argv).start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"simulator exited; see {proc.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/_sim/ledger", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"simulator did not start; see {proc.log_path}")
        self.sim_url = url
        self.env["GATEWAY_URL"] = url
        self.env["GATEWAY_CLIENT_SECRET"] = flags["secret"]
        return url

    def ledger(self) -> dict[str, Any]:
        """The simulator's ledger."""
        assert self.sim_url is not None
        data: dict[str, Any] = httpx.get(f"{self.sim_url}/_sim/ledger", timeout=30).json()
        return data

    def configure_simulator(self, **flags: Any) -> None:
        """Change the simulator's faults at run time."""
        assert self.sim_url is not None
        httpx.post(f"{self.sim_url}/_sim/config", json=flags, timeout=10).raise_for_status()

    # --- celery -------------------------------------------------------------------------
    def start_worker(
        self,
        concurrency: int | None = None,
        extra: Sequence[str] = (),
        queues: str = "payments,dlq",
        celery_defaults: bool = False,
    ) -> ManagedProcess:
        """Start one ``celery -A payment_worker worker`` process; ``extra``: more of
        Celery's worker options (e.g. ``-I module``, a benchmark's task); ``queues``: what
        it consumes from the start (a benchmark adds ``payments`` later, to every worker at
        once, with Celery's ``add_consumer``). Gossip, mingle and heartbeat events are off
        (a test's boot is a second shorter), unless ``celery_defaults``: then on, as with the
        plain command users run (a benchmark)."""
        self._counter += 1
        name = f"worker{self._counter}"
        slots = concurrency or self.concurrency
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "payment_worker",
            "worker",
            "-Q",
            queues,
            *(["-P", self.pool] if self.pool else []),
            *(["-c", str(slots)] if slots else []),
            "-n",
            f"{name}@%h",
            *(
                []
                if celery_defaults
                else ["--without-gossip", "--without-mingle", "--without-heartbeat"]
            ),
            "--loglevel",
            "WARNING",
            *extra,
        ]
        return self._proc(name, argv).start()

    def start_beat(self) -> ManagedProcess:
        """Start ``celery -A payment_worker beat`` (the sweeper's clock)."""
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "payment_worker",
            "beat",
            "--schedule",
            str(self.workdir / "beat-schedule"),
            "--loglevel",
            "WARNING",
        ]
        return self._proc("beat", argv).start()

    def workers(self) -> list[ManagedProcess]:
        """The worker processes started so far that are still alive."""
        return [p for p in self.processes if p.name.startswith("worker") and p.alive()]

    def stop(self) -> None:
        """Stop every process (workers first, the simulator last)."""
        for p in sorted(self.processes, key=lambda p: p.name == "gateway-sim"):
            p.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def periodic(interval: float, action: Any) -> Iterator[threading.Event]:
    """Run ``action()`` every ``interval`` seconds in a thread until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval):
            action()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(timeout=interval + 5)
