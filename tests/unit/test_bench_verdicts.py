"""``bench/throughput.py``'s verdict lines: the share printed is on the same side of the 80 %
line as the verdict (a run of 1,729 of 2,161 items/s printed "80 %" beside "NOT met")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def throughput() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the script imports its sibling modules by name
    try:
        spec = importlib.util.spec_from_file_location("bench_throughput", BENCH / "throughput.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _row(num: int, items_per_s: float, accounts: int, latency_ms: int = 0) -> dict[str, Any]:
    return {
        "num": num,
        "items_per_s": items_per_s,
        "accounts": accounts,
        "latency_ms": latency_ms,
        "unpaid": 0,
        "miscounted": 0,
        "double": 0,
        "in_flight_peak": accounts,
        "pg_conns": 10,
    }


@pytest.mark.parametrize(
    ("rate_4", "shown", "word"),
    [
        (1728.6, "79.9 % of its bound", "NOT met"),  # 79.98 %: not "80 %"
        (1729.2, "80.0 % of its bound", "met"),  # 80.01 %
        (1500.0, "69 % of its bound", "NOT met"),
        (1900.0, "88 % of its bound", "met"),
    ],
)
def test_the_share_printed_agrees_with_the_verdict(
    throughput: ModuleType, rate_4: float, shown: str, word: str
) -> None:
    rows = [_row(1, 2161.4, 200), _row(4, rate_4, 400, latency_ms=100)]
    throughput._bounds(rows)
    lines = throughput.verdicts(rows, 100.0, 10)
    four = next(line for line in lines if line.startswith("- (4)"))
    assert shown in four and four.endswith(f": {word}"), four
