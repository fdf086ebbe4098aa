"""Where each account's time goes inside the workers: phase stamps (issue 13, a diagnostic).

    .venv/bin/python bench/phases.py [--scenario 4] [-- more bench/throughput.py arguments]

Runs ``bench/throughput.py --scenario N`` (one run, the plain command) with
``bench/phase_stamps`` on the workers' ``PYTHONPATH``: in each worker process its
``sitecustomize`` stamps the drain's start and end, the lock taken, the first claim and every
gateway request sent and answered, per account. Then prints, over the accounts, when each
phase was reached and how long it took (quantiles 0 / 10 / 50 / 90 / 100 %, seconds from the
first task's start), and the gaps between an account's payments: its send rate between its
first and last payment, and how much of the time lost to long gaps falls on a chunk boundary
(every ``PROCESS_CHUNK_SIZE`` items the holder records and claims), and each gap split in
two: the request's round trip (from its send to its answer, as the worker stamps them: the
gateway's latency, the simulator's and the worker's queues) and the worker's own turn (from
the answer to the account's next send). The stamps patch
internals by name and cost the workers a little CPU: compare runs of this script with each
other, not with ``bench/throughput.py``'s tables. Uses DATABASE_URL / REDIS_URL as
``bench/throughput.py`` does.

``--cpu``: the machine's cores are sampled from ``/proc/stat`` every 0.1 s while it runs,
and the share of them busy is printed over the run's three spans: until the last account's
first payment left (the start), until the first drain ended (the payments), and until the
last one ended (the end); and per 0.1 s. Every process of the machine counts (workers,
simulator, Postgres, Redis), so run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = [
    ("task begins", "task"),
    ("lock taken", "locked"),
    ("first claim done", "claimed"),
    ("first payment sent", "create_sent"),
    ("first payment answered", "create_answered"),
    ("drain ends", "end"),
]
QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)
LONG_GAP_FACTOR = 1.3  # a gap longer than this many intervals counts as lost time


def _q(values: list[float]) -> str:
    xs = sorted(values)
    return " / ".join(f"{xs[round(q * (len(xs) - 1))]:.2f}" for q in QUANTILES)


def read(
    directory: Path,
) -> tuple[
    dict[str, dict[str, float]], dict[str, list[float]], dict[str, str], dict[str, list[float]]
]:
    """Each account's first stamp per event, its payments' send times, the worker process
    (pid) that drained it, and its payments' answer times."""
    first: dict[str, dict[str, float]] = collections.defaultdict(dict)
    sends: dict[str, list[float]] = collections.defaultdict(list)
    owner: dict[str, str] = {}
    answers: dict[str, list[float]] = collections.defaultdict(list)
    for path in directory.glob("ev-*.log"):
        pid = path.stem.removeprefix("ev-")
        for line in path.read_text().splitlines():
            at, event, account = line.split(" ", 2)
            if event.startswith("unpatched:"):
                print(f"# not stamped: {event}", file=sys.stderr)
                continue
            first[account].setdefault(event, float(at))
            if event == "task":
                owner.setdefault(account, pid)
            if event == "create_sent":
                sends[account].append(float(at))
            elif event == "create_answered":
                answers[account].append(float(at))
    return first, sends, owner, answers


def split_table(sends: dict[str, list[float]], answers: dict[str, list[float]]) -> list[str]:
    """A payment's gap split in two: from its send to its answer in the worker (the request's
    round trip: the gateway's latency, both processes' queues, the bytes both ways), and from
    the answer to the account's next send (the worker's own turn: the outcome, the next
    request, a wait for the GIL)."""
    trips, turns = [], []
    for account, sent in sends.items():
        got = sorted(answers.get(account, []))
        sent = sorted(sent)
        if len(got) != len(sent):
            continue  # a send without its answer (or the reverse): not paired
        trips += [(b - a) * 1000 for a, b in zip(sent, got, strict=True)]
        turns += [(b - a) * 1000 for a, b in zip(got, sent[1:], strict=False)]
    if not trips or not turns:
        return ["no account's payments could be paired with their answers"]
    return [
        f"send to answer (round trip), ms: {_q(trips)}",
        f"answer to the next send (the worker's turn), ms: {_q(turns)}",
    ]


def phase_table(first: dict[str, dict[str, float]]) -> list[str]:
    """When each phase was reached and how long it took, over the accounts that paid."""
    accounts = [a for a, ev in first.items() if "task" in ev and "create_answered" in ev]
    if not accounts:
        return ["no account was stamped from its task to a payment"]
    t0 = min(first[a]["task"] for a in accounts)
    rows = [
        f"{len(accounts)} accounts; seconds, quantiles {' / '.join(f'{q:.0%}' for q in QUANTILES)}",
        "",
        "| phase | reached at | since the phase before |",
        "|---|---|---|",
    ]
    before = None
    for label, event in PHASES:
        have = [a for a in accounts if event in first[a]]
        at = _q([first[a][event] - t0 for a in have])
        took = "-" if before is None else _q([first[a][event] - first[a][before] for a in have])
        rows.append(f"| {label} | {at} | {took} |")
        before = event
    return rows


def worker_table(first: dict[str, dict[str, float]], owner: dict[str, str]) -> list[str]:
    """Per worker process: how many accounts it drained, and when their drains ended."""
    ended = [a for a, ev in first.items() if "task" in ev and "end" in ev and a in owner]
    if not ended:
        return []
    t0 = min(first[a]["task"] for a in ended)
    rows = [
        "| worker pid | accounts | task begins at | drain ends at |",
        "|---|---|---|---|",
    ]
    for pid in sorted({owner[a] for a in ended}):
        mine = [a for a in ended if owner[a] == pid]
        begins = _q([first[a]["task"] - t0 for a in mine])
        ends = _q([first[a]["end"] - t0 for a in mine])
        rows.append(f"| {pid} | {len(mine)} | {begins} | {ends} |")
    return rows


def gap_table(sends: dict[str, list[float]], rate: float, chunk: int) -> list[str]:
    """Each account's payments: its rate between the first and the last, and the long gaps."""
    interval = 1.0 / rate
    rates, lost_boundary, lost_elsewhere, gaps = [], 0.0, 0.0, []
    for times in sends.values():
        times.sort()
        if len(times) < 2:
            continue
        rates.append((len(times) - 1) / (times[-1] - times[0]))
        for i, (a, b) in enumerate(itertools.pairwise(times), start=1):
            gap = b - a
            gaps.append(gap * 1000)
            if gap > LONG_GAP_FACTOR * interval:
                if i % chunk == 0:
                    lost_boundary += gap - interval
                else:
                    lost_elsewhere += gap - interval
    if not rates:
        return ["no account sent two payments"]
    n = len(rates)
    rows = [
        f"payments per second per account, between its first and last: {_q(rates)} "
        f"(quota {rate:g})",
        f"gaps between an account's payments, ms: {_q(gaps)}",
    ]
    if sorted(gaps)[len(gaps) // 2] > 2000 * interval:
        # the gateway's latency spaces the payments, not the quota: no pacing loss to count
        return [*rows, "the median gap is over two quota intervals: latency-bound, no loss counted"]
    return [
        *rows,
        f"time lost per account to gaps over {LONG_GAP_FACTOR:g} intervals: at a chunk boundary "
        f"(every {chunk} items) {lost_boundary / n:.3f} s, elsewhere {lost_elsewhere / n:.3f} s",
    ]


class CpuSampler(threading.Thread):
    """The machine's busy share from ``/proc/stat``: (wall time at the end, busy fraction)
    of each ``every`` seconds, until :meth:`stop`."""

    def __init__(self, every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.samples: list[tuple[float, float]] = []
        self._halt = threading.Event()

    @staticmethod
    def _read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    def run(self) -> None:
        total, idle = self._read()
        while not self._halt.wait(self.every):
            now_total, now_idle = self._read()
            spent = now_total - total
            if spent > 0:
                self.samples.append((time.time(), 1 - (now_idle - idle) / spent))
            total, idle = now_total, now_idle

    def stop(self) -> None:
        self._halt.set()
        self.join()


def cpu_table(first: dict[str, dict[str, float]], samples: list[tuple[float, float]]) -> list[str]:
    """The cores' busy share over the start, the payments and the end of the run."""
    paid = [a for a, ev in first.items() if "task" in ev and "create_sent" in ev and "end" in ev]
    if not paid or not samples:
        return ["no CPU samples, or no account stamped from its task to its end"]
    t0 = min(first[a]["task"] for a in paid)
    marks = [
        ("the accounts start: until the last first payment left", "create_sent", max),
        ("the payments: until the first drain ended", "end", min),
        ("the drains end: until the last one ended", "end", max),
    ]
    rows = ["| span | seconds from the first task | cores busy (mean of 0.1 s samples) |"]
    rows.append("|---|---|---|")
    start = t0
    for label, event, pick in marks:
        stop = pick(first[a][event] for a in paid)
        inside = [busy for at, busy in samples if start < at <= stop + 0.05]
        mean = f"{100 * sum(inside) / len(inside):.0f} %" if inside else "-"
        rows.append(f"| {label} | {start - t0:.2f} to {stop - t0:.2f} | {mean} |")
        start = stop
    per = [f"{at - t0:.1f}:{100 * busy:.0f}" for at, busy in samples if t0 < at <= start + 0.3]
    return [*rows, "", "cores busy per 0.1 s (seconds: %): " + " ".join(per)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", type=int, default=4)
    p.add_argument("--rate", type=float, default=100.0, help="as bench/throughput.py's")
    p.add_argument("--cpu", action="store_true", help="sample the cores' busy share")
    p.add_argument("rest", nargs="*", help="after --: more bench/throughput.py arguments")
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from payment_worker.settings import load_settings

    chunk = load_settings().process_chunk_size
    with tempfile.TemporaryDirectory(prefix="pw-phases-") as tmp:
        env = dict(os.environ, PW_PHASES_DIR=tmp)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE / "phase_stamps"), *filter(None, [env.get("PYTHONPATH")])]
        )
        command = [sys.executable, str(HERE / "throughput.py"), "--scenario", str(args.scenario)]
        command += ["--rate", f"{args.rate:g}", *args.rest]
        sampler = CpuSampler()
        if args.cpu:
            sampler.start()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        finally:
            if args.cpu:
                sampler.stop()
        for line in done.stdout.splitlines():
            if line.startswith(("# throughput", f"| {args.scenario}.")):
                print(line)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        first, sends, owner, answers = read(Path(tmp))
    print()
    print("\n".join(phase_table(first)))
    print()
    print("\n".join(worker_table(first, owner)))
    print()
    print("\n".join(gap_table(sends, args.rate, chunk)))
    print("\n".join(split_table(sends, answers)))
    if args.cpu:
        print()
        print("\n".join(cpu_table(first, sampler.samples)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
