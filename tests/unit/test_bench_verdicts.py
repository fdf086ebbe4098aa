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
    """The script as a module; sys.path and the sibling modules it imported by bare name
    (bench's own ``locks``, ``gateway``, ...) are put back as they were for later tests."""
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_throughput", BENCH / "throughput.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(BENCH)):
                del sys.modules[name]


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


@pytest.mark.parametrize(
    ("rate_1", "rate_3", "shown", "word"),
    [
        (3.0, 2.4, "= 80.0 % of (1)", "met"),  # 0.8 * 3.0 is 2.4000000000000004
        (2161.4, 1728.6, "= 79.9 % of (1)", "NOT met"),
        (2161.4, 1750.0, "= 81 % of (1)", "met"),
    ],
)
def test_scenario_three_prints_the_share_its_verdict_judged(
    throughput: ModuleType, rate_1: float, rate_3: float, shown: str, word: str
) -> None:
    rows = [_row(1, rate_1, 200), _row(3, rate_3, 20)]
    throughput._bounds(rows)
    three = next(line for line in throughput.verdicts(rows, 100.0, 10) if line.startswith("- (3)"))
    assert shown in three and three.endswith(f": {word}"), three
