"""Gateway benchmarks: shared tokens vs a per-process cache, client overhead, simulator req/s.

    .venv/bin/python bench/gateway.py                  # all three parts, the issue's sizes
    .venv/bin/python bench/gateway.py --part tokens --duration 20

Needs Redis (REDIS_URL, or the embedded one under PAYMENT_WORKER_HOME). Starts its own
simulator. Prints one table per part; results go to docs/benchmarks-gateway.md by hand.

1. tokens: W worker threads in P processes over A accounts for D seconds, token TTL T.
   Each call takes an account exclusively from a shared queue (as the account lock does in
   the service), makes one create_payment, and puts the account back. "shared" is
   GatewayClient (Redis token, one refresher); "naive" keeps a token cache per process
   (refresh when expired, compare-and-refresh after a 401), everything else equal.
2. overhead: one thread, zero simulator latency: GatewayClient.create_payment vs a bare
   httpx POST on a pooled connection with a ready token; the difference is the client's
   cost (Redis token read + pacing script + classification + metrics).
3. throughput: an aiohttp load generator, C connections, each its own accounts, against
   the simulator's create endpoint (auth, limits, validation, idempotency store, ledger).
4. http: one thread, zero simulator latency: CPU per create request of each HTTP stack the
   client could use, the same request on a kept connection, blocks of 100 alternated:
   ``httpx.Client``, an ``httpcore`` pool (the client's stack until the fifth session of
   issue 13), and ``GatewayConnection`` over ``http.client`` (the client's stack now).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from _env import create_request, process_cpu_seconds  # noqa: E402

from payment_worker.domain.payment_request import PaymentRequest  # noqa: E402
from payment_worker.gateway import GatewayClient, GatewayResult  # noqa: E402
from payment_worker.gateway.outcomes import not_sent  # noqa: E402
from payment_worker.settings import Settings  # noqa: E402
from tests.sim_fixtures import gateway_client, run_simulator  # noqa: E402

BEN = {"bank_code": "014", "account_number": "1234567890", "name": "Budi"}


def payment(account: str, tx_id: str) -> PaymentRequest:
    return PaymentRequest(account, tx_id, 150000, "IDR", BEN)


# --- the baseline: a token cache per process --------------------------------------------
class NaiveTokens:
    """Per-process token cache with the same interface as TokenManager.get."""

    def __init__(self, client: GatewayClient) -> None:
        send = client._send_token
        self._fetch: Callable[[str], Any] = lambda account_id: send(account_id).read()
        self._cache: dict[str, tuple[str, float]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, account_id: str, rejected: str | None = None) -> str | GatewayResult:
        with self._guard:
            lock = self._locks.setdefault(account_id, threading.Lock())
        with lock:  # one refresh per account per process, at least
            cur = self._cache.get(account_id)
            if cur is not None and cur[0] != rejected and time.monotonic() < cur[1]:
                return cur[0]
            t0 = time.monotonic()
            resp = self._fetch(account_id)
            if resp.status_code != 200:
                return not_sent("token", f"token request: HTTP {resp.status_code}")
            data = resp.json()
            self._cache[account_id] = (data["access_token"], t0 + data["expires_in"] * 0.98)
            return str(data["access_token"])


def _token_worker(
    mode: str, threads: int, duration: float, q: Any, ready: Any, go: Any, out: Any
) -> None:
    from payment_worker.ops.logging import configure_logging

    configure_logging("WARNING")
    client = gateway_client(Settings())
    if mode == "naive":
        client.tokens = NaiveTokens(client)
    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()

    def loop(tid: int) -> None:
        go.wait()
        end, i = time.monotonic() + duration, 0
        while time.monotonic() < end:
            acct = q.get()
            try:
                p = payment(acct, f"{os.getpid()}-{tid}-{i}")
                t0 = time.perf_counter()
                r = client.create_payment(acct, p, p.idempotency_key)
                dt = time.perf_counter() - t0
            finally:
                q.put(acct)
            i += 1
            with lock:
                outcomes[f"{r.outcome.value}:{r.http_status}"] += 1
                latencies.append(dt)

    ts = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    ready.put(1)
    for t in ts:
        t.join()
    client.close()
    out.put(json.dumps({"outcomes": outcomes, "latencies": latencies}))


def run_tokens(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    sim_flags = {
        "token_ttl": args.token_ttl,
        "latency_ms": args.latency_ms,
        "latency_jitter_ms": args.jitter_ms,
        "seed": 7,
    }
    with run_simulator(**sim_flags) as sim:
        os.environ["GATEWAY_URL"] = sim.url
        os.environ["REDIS_KEY_PREFIX"] = f"pwbench-{uuid.uuid4().hex[:8]}"
        ctx = multiprocessing.get_context("spawn")
        q, ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
        for a in range(args.accounts):
            q.put(f"acct-{a:04d}")
        per = [args.workers // args.processes + (i < args.workers % args.processes) for i in
               range(args.processes)]  # fmt: skip
        procs = [
            ctx.Process(target=_token_worker, args=(mode, n, args.duration, q, ready, go, out))
            for n in per
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        parts = [json.loads(out.get(timeout=args.duration + 120)) for _ in procs]
        for p in procs:
            p.join(30)
        ledger = sim.ledger()
    outcomes: Counter[str] = Counter()
    lat: list[float] = []
    for part in parts:
        outcomes.update(part["outcomes"])
        lat += part["latencies"]
    periods = args.duration / args.token_ttl
    tokens = ledger["tokens_issued"]
    return {
        "mode": mode,
        "calls": sum(outcomes.values()),
        "calls_per_s": sum(outcomes.values()) / args.duration,
        "tokens_issued": tokens,
        "tokens_per_account_per_ttl": tokens / args.accounts / periods,
        "after_first_per_ttl": (tokens - len(ledger["tokens_issued_per_account"]))
        / args.accounts
        / periods,
        "http_401": ledger["http_401"],
        "http_429": ledger["http_429"],
        "double_payments": len(ledger["double_payments"]),
        "p50_ms": statistics.median(lat) * 1000 if lat else 0.0,
        "p99_ms": statistics.quantiles(lat, n=100)[98] * 1000 if len(lat) > 100 else 0.0,
        "outcomes": dict(outcomes),
    }


# --- part 2: client overhead --------------------------------------------------------------
def run_overhead(args: argparse.Namespace) -> dict[str, float]:
    n = args.overhead_calls
    with run_simulator(rate=1_000_000, seed=3) as sim:
        s = Settings(
            gateway_url=sim.url,
            redis_key_prefix=f"pwbench-{uuid.uuid4().hex[:8]}",
            gateway_rate_per_second=1_000_000,
        )
        client = gateway_client(s)
        raw = httpx.Client(base_url=sim.url, timeout=5)
        grant = {"grant_type": "client_credentials", "client_secret": "sim-secret"}
        accounts = [f"ov-{i}" for i in range(50)]
        for a in accounts:  # the client's shared tokens and connections, ready
            client.lookup_payment(a, "pw1-warm")
        # the bare requests use accounts of their own ("raw-..."), so no token is revoked
        raw_tok = {}
        for a in accounts:
            resp = raw.post("/oauth/token", json={**grant, "client_id": f"raw-{a}"})
            raw_tok[a] = resp.json()["access_token"]

        def raw_call(i: int) -> float:
            a = accounts[i % len(accounts)]
            p = payment(f"raw-{a}", f"raw-{i}-{uuid.uuid4().hex[:6]}")
            headers = {
                "Authorization": f"Bearer {raw_tok[a]}",
                "Idempotency-Key": p.idempotency_key,
            }
            t0 = time.perf_counter()
            r = raw.post(f"/v1/accounts/raw-{a}/payments", json=p.body(), headers=headers)
            dt = time.perf_counter() - t0
            assert r.status_code == 201, r.text
            return dt

        def client_call(i: int) -> float:
            a = accounts[i % len(accounts)]
            p = payment(a, f"cl-{i}-{uuid.uuid4().hex[:6]}")
            t0 = time.perf_counter()
            r = client.create_payment(a, p, p.idempotency_key)
            dt = time.perf_counter() - t0
            assert r.http_status == 201, r
            return dt

        def parts_call(i: int) -> tuple[float, float]:
            a = accounts[i % len(accounts)]
            t0 = time.perf_counter()
            client.tokens.get(a)
            t1 = time.perf_counter()
            client.pacer.try_acquire(a, 1_000_000)
            return t1 - t0, time.perf_counter() - t1

        for i in range(200):  # warm up
            raw_call(i), client_call(i)
        # alternate the two, so that load from elsewhere hits both alike
        raw_t, cl_t, tok_t, pace_t = [], [], [], []
        for i in range(n):
            raw_t.append(raw_call(i))
            cl_t.append(client_call(i))
            tok, pace = parts_call(i)
            tok_t.append(tok)
            pace_t.append(pace)
        client.close()
        raw.close()
    diffs = [c - r for c, r in zip(cl_t, raw_t, strict=True)]
    us = 1e6
    return {
        "raw_mean_us": statistics.mean(raw_t) * us,
        "client_mean_us": statistics.mean(cl_t) * us,
        "raw_p50_us": statistics.median(raw_t) * us,
        "client_p50_us": statistics.median(cl_t) * us,
        "overhead_mean_us": statistics.mean(diffs) * us,
        "overhead_p50_us": statistics.median(diffs) * us,
        "token_p50_us": statistics.median(tok_t) * us,
        "pace_p50_us": statistics.median(pace_t) * us,
        "token_mean_us": statistics.mean(tok_t) * us,
        "pace_mean_us": statistics.mean(pace_t) * us,
    }


# --- part 3: simulator throughput ---------------------------------------------------------
async def _load(url: str, conns: int, seconds: float) -> tuple[int, Counter[int]]:
    import aiohttp

    statuses: Counter[int] = Counter()
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as s:
        grant = {"grant_type": "client_credentials", "client_secret": "sim-secret"}

        async def conn(c: int) -> None:
            accts = [f"tp-{c}-{k}" for k in range(5)]
            toks = {}
            for a in accts:
                async with s.post(f"{url}/oauth/token", json={**grant, "client_id": a}) as r:
                    toks[a] = (await r.json())["access_token"]
            i = 0
            while time.monotonic() < stop:
                a = accts[i % len(accts)]
                p = payment(a, f"{c}-{i}")
                headers = {"Authorization": f"Bearer {toks[a]}", "Idempotency-Key": f"k-{c}-{i}"}
                async with s.post(
                    f"{url}/v1/accounts/{a}/payments", json=p.body(), headers=headers
                ) as r:
                    await r.read()
                    statuses[r.status] += 1
                i += 1

        t0 = time.monotonic()
        await asyncio.gather(*(conn(c) for c in range(conns)))
        elapsed = time.monotonic() - t0
    return int(sum(statuses.values()) / elapsed), statuses


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    with run_simulator(rate=1_000_000, token_rate=1000, seed=5) as sim:
        cpu0 = process_cpu_seconds(sim.proc.pid)
        rps, statuses = asyncio.run(_load(sim.url, args.connections, args.throughput_seconds))
        cpu = process_cpu_seconds(sim.proc.pid) - cpu0
    n = sum(statuses.values())
    return {
        "req_per_s": rps,
        "statuses": dict(statuses),
        "cpu_us_per_req": cpu / n * 1e6 if n else 0.0,
        "one_core_req_per_s": n / cpu if cpu else 0.0,
    }


# --- part 4: HTTP stacks --------------------------------------------------------------------
def run_http(args: argparse.Namespace) -> dict[str, float]:
    import httpcore

    from payment_worker.gateway.connection import GatewayConnection

    n, block = args.http_calls, 100
    with run_simulator(rate=1_000_000, seed=4) as sim:
        base = httpx.URL(sim.url)
        host, port = base.host, base.port or 80
        grant = {"grant_type": "client_credentials", "client_secret": "sim-secret"}
        with httpx.Client(base_url=sim.url, timeout=5) as x:
            tokens = {
                f"{stack}-{i}": x.post(
                    "/oauth/token", json={**grant, "client_id": f"{stack}-{i}"}
                ).json()["access_token"]
                for stack in ("httpx", "httpcore", "http.client")
                for i in range(20)
            }
        seq = iter(range(10**9))

        def request(stack: str) -> tuple[str, dict[str, str], bytes]:
            i = next(seq)
            a = f"{stack}-{i % 20}"
            return create_request(base.netloc.decode(), tokens[a], payment(a, f"t-{i}"))

        hx = httpx.Client(base_url=sim.url, timeout=5)
        core = httpcore.ConnectionPool(max_connections=1, max_keepalive_connections=1)
        conn = GatewayConnection("http", host, port, connect_timeout=5, read_timeout=5)

        def via_httpx() -> int:
            path, headers, body = request("httpx")
            return hx.post(path, content=body, headers=headers).status_code

        def via_httpcore() -> int:
            path, headers, body = request("httpcore")
            url = httpcore.URL(scheme=b"http", host=host.encode(), port=port, target=path.encode())
            hdrs = [(k.encode(), v.encode()) for k, v in headers.items()]
            hdrs.append((b"Content-Length", str(len(body)).encode()))
            timeout = {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}
            r = core.request(b"POST", url, headers=hdrs, content=body,
                             extensions={"timeout": timeout})  # fmt: skip
            return r.status

        def via_http_client() -> int:
            path, headers, body = request("http.client")
            return conn.request("POST", path, headers, body).status_code

        stacks = {"httpx.Client": via_httpx, "httpcore pool": via_httpcore,
                  "GatewayConnection (http.client)": via_http_client}  # fmt: skip
        cpu = dict.fromkeys(stacks, 0.0)
        for f in stacks.values():  # warm: connections, imports
            for _ in range(50):
                assert f() == 201
        for _ in range(max(1, n // block)):
            for name, f in stacks.items():
                t0 = time.process_time()
                for _ in range(block):
                    assert f() == 201
                cpu[name] += time.process_time() - t0
        hx.close()
        core.close()
        conn.close()
    # the request's own making (payment, key, JSON) is in every row alike
    return {name: c / (max(1, n // block) * block) * 1e6 for name, c in cpu.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--part", choices=["all", "tokens", "overhead", "throughput", "http"], default="all"
    )
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--accounts", type=int, default=200)
    p.add_argument("--token-ttl", type=float, default=10.0)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--jitter-ms", type=float, default=3.0)
    p.add_argument("--modes", default="shared,naive")
    p.add_argument("--overhead-calls", type=int, default=2000)
    p.add_argument("--http-calls", type=int, default=3000)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--throughput-seconds", type=float, default=10.0)
    args = p.parse_args()
    from payment_worker.ops.logging import configure_logging
    from payment_worker.runtime import ServiceUrls
    from payment_worker.settings import load_settings

    configure_logging("WARNING")
    os.environ["REDIS_URL"] = ServiceUrls.resolve(
        load_settings()
    ).redis  # children use the same Redis, never start another
    fraction = Settings().gateway_token_refresh_fraction
    print(
        f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}; "
        f"load average at start {os.getloadavg()[0]:.1f}"
    )

    if args.part in ("all", "tokens"):
        print(
            f"\n## tokens: {args.workers} workers in {args.processes} processes, "
            f"{args.accounts} accounts, {args.duration:.0f} s, token TTL {args.token_ttl:.0f} s, "
            f"latency {args.latency_ms:.0f}±{args.jitter_ms:.0f} ms, refresh fraction {fraction}"
        )
        cols = ("mode", "calls/s", "tokens", "tok/acct/TTL", "excl. first", "401s", "429s",
                "double", "p50 ms", "p99 ms")  # fmt: skip
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for mode in args.modes.split(","):
            r = run_tokens(args, mode)
            print(
                f"| {mode} | {r['calls_per_s']:.0f} | {r['tokens_issued']} | "
                f"{r['tokens_per_account_per_ttl']:.2f} | {r['after_first_per_ttl']:.2f} | "
                f"{r['http_401']} | {r['http_429']} | {r['double_payments']} | "
                f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |",
                flush=True,
            )
            print(f"<!-- {mode} outcomes: {r['outcomes']} -->", flush=True)

    if args.part in ("all", "overhead"):
        r2 = run_overhead(args)
        print(f"\n## client overhead: {args.overhead_calls} sequential creates, zero latency")
        print("| | mean µs | p50 µs |\n|---|---|---|")
        print(f"| bare httpx POST | {r2['raw_mean_us']:.0f} | {r2['raw_p50_us']:.0f} |")
        print(f"| GatewayClient | {r2['client_mean_us']:.0f} | {r2['client_p50_us']:.0f} |")
        print(
            f"| overhead (paired difference) | {r2['overhead_mean_us']:.0f} | "
            f"{r2['overhead_p50_us']:.0f} |"
        )
        print(
            f"| of which: shared token read | {r2['token_mean_us']:.0f} | "
            f"{r2['token_p50_us']:.0f} |"
        )
        print(f"| of which: pacing script | {r2['pace_mean_us']:.0f} | {r2['pace_p50_us']:.0f} |")

    if args.part in ("all", "http"):
        r4 = run_http(args)
        print(f"\n## HTTP stacks: {args.http_calls} creates each, one thread, zero latency")
        print("| stack | CPU µs per request |\n|---|---|")
        for name, us in r4.items():
            print(f"| {name} | {us:.0f} |")

    if args.part in ("all", "throughput"):
        r3 = run_throughput(args)
        print(
            f"\n## simulator throughput: {args.connections} connections, "
            f"{args.throughput_seconds:.0f} s, creates (load generator on the same machine)"
        )
        print("| req/s | simulator CPU µs/req | req/s per full core | statuses |")
        print(
            f"|---|---|---|---|\n| {r3['req_per_s']} | {r3['cpu_us_per_req']:.0f} | "
            f"{r3['one_core_req_per_s']:.0f} | {r3['statuses']} |"
        )
        print(f"load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
