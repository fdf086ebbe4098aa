"""Worker CPU per message of Celery itself on our configuration (issue 13).

    .venv/bin/python bench/celery_task.py                      # 2,000 tasks of 1 s, 3 rounds
    .venv/bin/python bench/celery_task.py --slots 1000 50 --sleep 0.05

One real worker, the plain ``celery -A payment_worker worker`` (threads, the settings'
slots unless ``--slots`` gives ``WORKER_CONCURRENCY``), plus a task that only sleeps
(``bench/_noop_task.py``): what remains is Celery's and kombu's cost of a message (the
delivery, the unacked record, the request, the thread hand-over, the ack). The tasks are
published before they are timed; the worker's CPU (``/proc``) from the first publish until
the queue and kombu's unacked record are empty, its idle rate subtracted, divided by the
tasks. Scratch database and Redis dbs (bench/_env.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _env import git_rev, machine, process_cpu_seconds, scratch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def one_round(
    slots: int | None, tasks: int, sleep_s: float, broker_url: str
) -> tuple[float, float]:
    """(worker CPU µs per task, seconds until all were acked) for one worker."""
    import redis

    from payment_worker.dev.local_cluster import LocalCluster

    broker = redis.Redis.from_url(broker_url)
    broker.flushdb()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)])}
    env["METRICS_PORT"] = "0"
    if slots is not None:
        env["WORKER_CONCURRENCY"] = str(slots)
    workdir = Path(tempfile.mkdtemp(prefix="pw-bench-celery-"))
    # pool and concurrency None: the plain command, the settings decide
    with LocalCluster(workdir=workdir, env=env, concurrency=None, pool=None) as cluster:
        worker = cluster.start_worker(extra=["-I", "_noop_task"])
        deadline = time.monotonic() + 60
        while b"heap_frozen" not in worker.log_path.read_bytes():
            if not worker.alive() or time.monotonic() > deadline:
                raise SystemExit(f"the worker did not start: {worker.log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(1.0)
        c0 = process_cpu_seconds(worker.pid)
        time.sleep(2.0)
        idle = (
            process_cpu_seconds(worker.pid) - c0
        ) / 2.0  # heartbeat, sweeper thread: not the tasks'
        from _noop_task import noop

        c0, t0 = process_cpu_seconds(worker.pid), time.monotonic()
        for _ in range(tasks):
            noop.apply_async((sleep_s,))
        print(f"# published in {time.monotonic() - t0:.2f} s", flush=True)
        while broker.llen("payments") or broker.hlen("unacked"):
            if time.monotonic() - t0 > 600:
                raise SystemExit("the tasks did not finish in 600 s")
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        used = process_cpu_seconds(worker.pid) - c0 - idle * elapsed
    return used / tasks * 1e6, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--sleep", type=float, default=1.0, help="seconds each task waits")
    parser.add_argument(
        "--slots",
        type=int,
        nargs="*",
        default=[],
        help="WORKER_CONCURRENCY values (none: the default)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    slots: list[int | None] = list(args.slots) or [None]
    with scratch() as (_db, _r_app, r_broker):
        from payment_worker import runtime

        default = runtime.current().settings.concurrency_for("threads")
        results: dict[int | None, list[tuple[float, float]]] = {s: [] for s in slots}
        for _ in range(args.rounds):
            for s in slots:  # alternated: a host whose speed drifts moves all alike
                results[s].append(one_round(s, args.tasks, args.sleep, r_broker))
    print(f"# celery task  machine: {machine()}  commit: {git_rev()}")
    print(f"# {args.tasks} tasks of {args.sleep} s a round, {args.rounds} rounds; the median")
    print()
    print("| slots | worker CPU µs per task | seconds until acked | rounds (µs, seconds) |")
    print("|---|---|---|---|")
    for s, runs in results.items():
        cpu = statistics.median(r[0] for r in runs)
        secs = statistics.median(r[1] for r in runs)
        every = ", ".join(f"{r[0]:,.0f} ({r[1]:.1f} s)" for r in runs)
        label = f"{default} (default)" if s is None else str(s)
        print(f"| {label} | {cpu:,.0f} | {secs:.1f} | {every} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
