"""The gateway simulator as a real subprocess, for tests and benchmarks.

``run_simulator(**flags)`` starts ``payment-worker gateway-sim`` on a free port and stops it;
the ``gateway_sim`` fixture hands each test a reset simulator (one process per pytest
session, state and config reset before every test) with GATEWAY_URL set. ``burst_worker``
is a process body for multi-process client tests.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class SimHandle:
    """A running simulator: its URL and its control endpoints."""

    url: str
    proc: subprocess.Popen[str]
    flags: dict[str, Any] = field(default_factory=dict)

    def _http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0)

    def ledger(self) -> dict[str, Any]:
        """``GET /_sim/ledger``."""
        with self._http() as c:
            out: dict[str, Any] = c.get("/_sim/ledger").raise_for_status().json()
            return out

    def configure(self, **flags: Any) -> dict[str, Any]:
        """``POST /_sim/config`` with fault flags / limits (python names: p_lost, token_ttl)."""
        with self._http() as c:
            out: dict[str, Any] = c.post("/_sim/config", json=flags).raise_for_status().json()
            return out

    def reset(self) -> None:
        """``POST /_sim/reset``: forget tokens, payments, scripts and the ledger."""
        with self._http() as c:
            c.post("/_sim/reset").raise_for_status()

    def script(self, account_id: str, *answers: dict[str, Any]) -> None:
        """Queue forced answers for the account's next requests (see ``POST /_sim/script``)."""
        with self._http() as c:
            body = {"account_id": account_id, "answers": list(answers)}
            c.post("/_sim/script", json=body).raise_for_status()

    def requests(self, account_id: str) -> list[list[Any]]:
        """The account's requests as ``[t, endpoint, status]`` on the simulator's clock."""
        with self._http() as c:
            data = c.get("/_sim/requests", params={"account_id": account_id}).json()
            out: list[list[Any]] = data["requests"]
            return out

    def now(self) -> float:
        """Seconds on the simulator's clock (the time base of :meth:`requests`)."""
        with self._http() as c:
            return float(c.get("/_sim/requests").raise_for_status().json()["now"])

    def statuses(self, account_id: str, endpoint: str) -> list[Any]:
        """What the account's requests to ``endpoint`` got, in order.

        Each is a status or, for a reset connection, a marker: "lost", "held" or "outage".
        """
        return [status for _, e, status in self.requests(account_id) if e == endpoint]

    def wait_for_holds(self, timeout: float = 30.0) -> dict[str, Any]:
        """Poll the ledger until no key is held in flight any more; returns that ledger.

        A held create is applied when its hold ends, after its request has returned: wait
        for this before asserting on ``sends`` or reconciling.
        """
        deadline = time.monotonic() + timeout
        while True:
            ledger = self.ledger()
            if ledger["holds_pending"] == 0:
                return ledger
            if time.monotonic() > deadline:
                raise TimeoutError(f"{ledger['holds_pending']} keys still held after {timeout}s")
            time.sleep(0.05)


def _argv(flags: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in flags.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


@contextlib.contextmanager
def run_simulator(**flags: Any) -> Iterator[SimHandle]:
    """Start the simulator as a subprocess on a free port, wait until it listens, stop it."""
    cmd = [sys.executable, "-m", "payment_worker.cli", "gateway-sim", "--port", "0", *_argv(flags)]
    with tempfile.TemporaryFile("w+", prefix="gw-sim-") as errlog:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=errlog, text=True, bufsize=1
        )
        line: list[str] = []

        def read_ready_line() -> None:
            line.append(proc.stdout.readline() if proc.stdout else "")

        reader = threading.Thread(target=read_ready_line, daemon=True)
        reader.start()
        reader.join(30)
        try:
            if not line or "listening on " not in line[0]:
                errlog.seek(0)
                raise RuntimeError(f"gateway-sim did not start: {line!r} {errlog.read()[-2000:]}")
            url = line[0].split("listening on ", 1)[1].strip()
            yield SimHandle(url=url, proc=proc, flags=flags)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout:
                proc.stdout.close()


@pytest.fixture(scope="session")
def _gateway_sim_process() -> Iterator[SimHandle]:
    with run_simulator(seed=1) as sim:
        yield sim


@pytest.fixture
def gateway_sim(
    _gateway_sim_process: SimHandle, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SimHandle]:
    """A simulator with default config and empty state; GATEWAY_URL points at it."""
    from payment_worker import runtime
    from payment_worker.dev.simulator_state import SimConfig

    sim = _gateway_sim_process
    defaults = SimConfig().as_dict()
    # the secret too (as_dict leaves it out): a test that rotated it must not leak into the next
    sim.configure(**defaults, secret=SimConfig().secret)
    sim.reset()
    monkeypatch.setenv("GATEWAY_URL", sim.url)
    runtime.reset()
    yield sim
    runtime.reset()


# --- multi-process client bursts ----------------------------------------------------------
def burst_worker(spec: dict[str, Any], ready: Any, go: Any, out: Any) -> None:
    """Process body: ``spec["threads"]`` threads each make one client call when ``go`` is set.

    spec: threads, account_id, tx_prefix, kind ("create" | "lookup"). Puts one JSON list of
    per-call results ``{"outcome", "status", "t0", "t1"}`` (wall clock) on ``out``.
    """
    from payment_worker.domain.payment_request import PaymentRequest
    from payment_worker.settings import Settings

    client = gateway_client(Settings())
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        go.wait(30)
        tx = PaymentRequest(
            account_id=spec["account_id"],
            transaction_id=f"{spec['tx_prefix']}-{i}",
            amount=1000 + i,
            currency="IDR",
            beneficiary={"bank_code": "014", "account_number": "1234567890", "name": "Budi"},
        )
        t0 = time.time()
        if spec.get("kind", "create") == "create":
            res = client.create_payment(tx.account_id, tx, tx.idempotency_key)
        else:
            res = client.lookup_payment(tx.account_id, tx.idempotency_key)
        with lock:
            results.append(
                {
                    "account": spec["account_id"],
                    "outcome": res.outcome.value,
                    "status": res.http_status,
                    "t0": t0,
                    "t1": time.time(),
                }
            )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(spec["threads"])]
    for t in threads:
        t.start()
    ready.put(os.getpid())
    for t in threads:
        t.join(60)
    client.close()
    out.put(json.dumps(results))


def run_bursts(
    specs: list[dict[str, Any]], before_go: Callable[[], None] | None = None
) -> tuple[float, list[list[dict[str, Any]]]]:
    """Run one ``burst_worker`` process per spec; all threads start together.

    ``before_go`` runs once every process is up and waiting. Returns the wall-clock time
    of the start signal and each process's results.
    """
    ctx = multiprocessing.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    procs = [ctx.Process(target=burst_worker, args=(spec, ready, go, out)) for spec in specs]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=60)
        if before_go is not None:
            before_go()
        started = time.time()
        go.set()
        results = [json.loads(out.get(timeout=120)) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return started, results


def gateway_client(settings: Any) -> Any:
    """A gateway client of ``settings`` with a Redis client of the settings' ``REDIS_URL``."""
    import redis

    from payment_worker.gateway.client import GatewayClient

    return GatewayClient(settings, redis.Redis.from_url(settings.redis_url))
