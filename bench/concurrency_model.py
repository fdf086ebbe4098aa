"""CPU per gateway request with many accounts at once: one OS thread per account (the
worker's model) against one event loop carrying every account (issue 13).

    .venv/bin/python bench/concurrency_model.py                     # 400 accounts, 0 and 100 ms
    .venv/bin/python bench/concurrency_model.py --accounts 1000 --latency-ms 1000 --requests 5

Each account sends ``--requests`` creates one after another to the simulator (one in flight
per account, as the service does), and before each send spends ``--work-us`` of pure Python
CPU, a stand-in for the rest of an item's path in the worker (claim, record, decisions), so
that the client process is as saturated as a worker is. Two models, the same bytes on the
wire and the same answer parsing (status, headers, JSON body):

- ``threads``: one thread per account, each with the service's own ``GatewayConnection``
  (``http.client`` over a blocking socket), as a threads worker runs its accounts;
- ``asyncio``: one event loop in one thread, one coroutine and one asyncio stream per account.

The models alternate over ``--rounds``; for each, the client's CPU per request (this process,
user + system) minus the stand-in's own cost measured alone, and the simulator's CPU per
request. Question answered: at a real gateway latency, how much of a threads worker's CPU
per item is the waking of a thread per answer, and would one event loop per process spend
less? Starts its own simulator; needs nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from _env import create_request, git_rev, machine, process_cpu_seconds  # noqa: E402

from payment_worker.domain.payment_request import PaymentRequest  # noqa: E402
from payment_worker.gateway.connection import GatewayConnection  # noqa: E402
from tests.sim_fixtures import run_simulator  # noqa: E402

BEN = {"bank_code": "014", "account_number": "1234567890", "name": "Budi"}
MODELS = ("threads", "asyncio")


def spin(loops: int) -> int:
    """Pure interpreter work (small integer additions), the stand-in for the rest of an
    item's Python path in the worker."""
    x = 0
    for i in range(loops):
        x += i
    return x


def loops_for(us: float) -> int:
    """How many loops of :func:`spin` take about ``us`` µs of CPU here (one thread)."""
    n = 200_000
    t0 = time.process_time()
    spin(n)
    return max(0, int(us * n / ((time.process_time() - t0) * 1e6)))


def alone_seconds(loops: int, n: int) -> float:
    """CPU seconds of ``n`` stand-ins run back to back in this thread, no I/O: subtracted
    from each phase, measured right before it (the host's speed drifts)."""
    t0 = time.process_time()
    for _ in range(n):
        spin(loops)
    return time.process_time() - t0


def _payment(account: str, seq: int) -> PaymentRequest:
    return PaymentRequest(account, f"cm-{account}-{seq}", 150000, "IDR", BEN)


def run_threads(host: str, port: int, tokens: dict[str, str], args: argparse.Namespace) -> int:
    """One thread per account, as a threads worker runs them; the creates answered 201."""
    done = [0]
    lock = threading.Lock()
    start = threading.Barrier(len(tokens) + 1)

    def account(a: str) -> None:
        conn = GatewayConnection("http", host, port, connect_timeout=10, read_timeout=30)
        start.wait()
        ok = 0
        for i in range(args.requests):
            spin(args.loops)
            path, headers, body = create_request(f"{host}:{port}", tokens[a], _payment(a, i))
            answer = conn.request("POST", path, headers, body)
            json.loads(answer.content)
            ok += answer.status_code == 201
        conn.close()
        with lock:
            done[0] += ok

    threads = [threading.Thread(target=account, args=(a,)) for a in tokens]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    return done[0]


async def _account_async(host: str, port: int, token: str, a: str, args: argparse.Namespace) -> int:
    """One account's creates on its own asyncio stream (HTTP/1.1 kept alive, parsed by hand:
    status line, Content-Length, JSON body)."""
    reader, writer = await asyncio.open_connection(host, port)
    ok = 0
    for i in range(args.requests):
        spin(args.loops)
        path, headers, body = create_request(f"{host}:{port}", token, _payment(a, i))
        head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        block = await reader.readuntil(b"\r\n\r\n")
        lines = block.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = [line.split(":", 1) for line in lines[1:] if line]
        length = next(int(v) for k, v in fields if k.strip().lower() == "content-length")
        json.loads(await reader.readexactly(length))
        ok += status == 201
    writer.close()
    await writer.wait_closed()
    return ok


def run_asyncio(host: str, port: int, tokens: dict[str, str], args: argparse.Namespace) -> int:
    """Every account a coroutine on one event loop in this thread; the creates answered 201."""

    async def all_accounts() -> int:
        got = await asyncio.gather(
            *(_account_async(host, port, t, a, args) for a, t in tokens.items())
        )
        return sum(got)

    return asyncio.run(all_accounts())


def fetch_tokens(url: str, accounts: list[str]) -> dict[str, str]:
    """A token per account, fetched 50 at a time (not timed)."""
    grant = {"grant_type": "client_credentials", "client_secret": "sim-secret"}
    with httpx.Client(base_url=url, timeout=30) as x, ThreadPoolExecutor(50) as pool:

        def one(a: str) -> str:
            answer = x.post("/oauth/token", json={**grant, "client_id": a})
            token: str = answer.json()["access_token"]
            return token

        return dict(zip(accounts, pool.map(one, accounts), strict=True))


def one_latency(latency_ms: float, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Both models, alternated over the rounds, against one simulator at ``latency_ms``."""
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODELS}
    runners = {"threads": run_threads, "asyncio": run_asyncio}
    with run_simulator(rate=1_000_000, latency_ms=latency_ms, seed=7) as sim:
        base = httpx.URL(sim.url)
        host, port = base.host, base.port or 80
        for rnd in range(args.rounds):
            for model in MODELS:
                tag = f"{model}-{latency_ms:g}-{rnd}"
                tokens = fetch_tokens(sim.url, [f"{tag}-{i}" for i in range(args.accounts)])
                n = args.accounts * args.requests
                alone = alone_seconds(args.loops, n)
                cpu0, sim0, wall0 = (
                    time.process_time(),
                    process_cpu_seconds(sim.proc.pid),
                    time.monotonic(),
                )
                ok = runners[model](host, port, tokens, args)
                cpu1, sim1, wall1 = (
                    time.process_time(),
                    process_cpu_seconds(sim.proc.pid),
                    time.monotonic(),
                )
                if ok != n:
                    raise SystemExit(f"{tag}: {ok} of {n} creates answered 201")
                results[model].append(
                    {
                        "client_us": (cpu1 - cpu0 - alone) / n * 1e6,
                        "sim_us": (sim1 - sim0) / n * 1e6,
                        "req_s": n / (wall1 - wall0),
                    }
                )
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--accounts", type=int, default=400)
    p.add_argument("--requests", type=int, default=20, help="creates per account, in sequence")
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 100.0])
    p.add_argument(
        "--work-us", type=float, default=400.0, help="Python CPU per request besides HTTP"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--switch-ms", type=float, help="sys.setswitchinterval for the run (CPython: 5)")
    args = p.parse_args()
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1000)
    args.loops = loops_for(args.work_us)
    print(f"# concurrency model  machine: {machine()}  commit: {git_rev()}  pid {os.getpid()}")
    print(
        f"# {args.accounts} accounts x {args.requests} creates, {args.work_us:g} µs of stand-in "
        f"work per request, {args.rounds} alternated rounds, switch interval "
        f"{sys.getswitchinterval() * 1000:g} ms; client CPU excludes the stand-in\n"
    )
    print(
        "| latency | model | client CPU µs per request (median; every round) "
        "| simulator CPU µs per request | requests/s |"
    )
    print("|---|---|---|---|---|")
    for lat in args.latency_ms:
        res = one_latency(lat, args)
        for model in MODELS:
            rows = res[model]
            c = [r["client_us"] for r in rows]
            every = ", ".join(f"{v:,.0f}" for v in c)
            print(
                f"| {lat:g} ms | {model} | **{statistics.median(c):,.0f}** ({every}) "
                f"| {statistics.median(r['sim_us'] for r in rows):,.0f} "
                f"| {statistics.median(r['req_s'] for r in rows):,.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
