"""The simulator holds thousands of slow requests at once and counts the accounts in flight
(``GET /_sim/in_flight``), which the throughput benchmark and the concurrency test rely on."""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import aiohttp

from tests.sim_fixtures import run_simulator

ACCOUNTS = 2000


async def _burst(url: str) -> tuple[list[int], list[dict[str, Any]]]:
    """One token request per account, all at once; the in-flight count sampled meanwhile."""
    samples: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def token(i: int) -> int:
            grant = {
                "grant_type": "client_credentials",
                "client_id": f"acct-{i}",
                "client_secret": "sim-secret",
            }
            async with http.post(f"{url}/oauth/token", json=grant) as resp:
                return resp.status

        async def sample() -> None:
            while True:
                async with http.get(f"{url}/_sim/in_flight") as resp:
                    samples.append(await resp.json())
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        statuses = await asyncio.gather(*(token(i) for i in range(ACCOUNTS)))
        sampler.cancel()
        async with http.get(f"{url}/_sim/in_flight") as resp:
            samples.append(await resp.json())
    return statuses, samples


def test_two_thousand_slow_requests_at_once_are_held_and_counted() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # this process holds one socket per request too
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with run_simulator(latency_ms=5000, seed=1) as sim:
        statuses, samples = asyncio.run(_burst(sim.url))
    assert statuses == [200] * ACCOUNTS
    # every account's request was in progress at the same moment (5 s each, sent together)
    assert samples[-1]["max"] == ACCOUNTS
    assert samples[-1]["now"] == 0
    assert max(s["now"] for s in samples) > ACCOUNTS // 2
