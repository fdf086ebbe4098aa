"""A real process for the pacing tests: ``python -m tests.pacing_helpers --account A ...``.

It builds a gateway client from the environment's settings (REDIS_URL, GATEWAY_URL,
GATEWAY_RATE_PER_SECOND, GATEWAY_PACING_LEASE_SECONDS), fetches the account's token, prints
``ready``, waits for a line on stdin, then sends payments from several threads for
``--seconds``.
The moment each request is let go (the guard right before the send) is recorded on
CLOCK_MONOTONIC, which every process of the machine shares. Prints one JSON line:
``{"sent": [...], "outcomes": {...}, "scripts": n}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--account", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()

    import redis

    from payment_worker.domain.payment_request import PaymentRequest
    from payment_worker.gateway.client import GatewayClient
    from payment_worker.settings import Settings

    settings = Settings()
    client = GatewayClient(settings, redis.Redis.from_url(settings.redis_url or ""))
    client.tokens.get(args.account)  # the token first: the timing below is pacing only
    sent: list[float] = []
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def stamp() -> None:
        with lock:
            sent.append(time.monotonic())

    def run(thread: int) -> None:
        end = time.time() + args.seconds
        i = 0
        while time.time() < end:
            tx = PaymentRequest(
                account_id=args.account,
                transaction_id=f"{args.name}-{thread}-{i}",
                amount=1000 + i,
                currency="IDR",
                beneficiary={"bank_code": "014", "account_number": "1234567890", "name": "B"},
            )
            res = client.create_payment(args.account, tx, tx.idempotency_key, guard=stamp)
            with lock:
                outcomes[f"{res.outcome.value}:{res.http_status}"] += 1
            i += 1

    print("ready", flush=True)
    sys.stdin.readline()
    threads = [threading.Thread(target=run, args=(t,)) for t in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out: dict[str, Any] = {"sent": sent, "outcomes": outcomes, "scripts": client.pacer.scripts}
    print(json.dumps(out), flush=True)
    client.close()


if __name__ == "__main__":
    main()
