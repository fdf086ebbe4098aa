"""One JSON log stream: a real worker (stderr a file, not a terminal) through a small end to
end run; every stderr line is a JSON object, Celery's own lines included, and the lines
about an item carry the task, batch, account and item context (docs/logging.md). Celery's
two lines per message come out with ``LOG_TASK_LINES=true`` only."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import PwEnv
from tests.integration import secret_flow as flow


@pytest.mark.parametrize("task_lines", [None, "true"], ids=["default", "task-lines"])
def test_worker_writes_one_json_stream_with_context(
    pw_env: PwEnv, tmp_path: Path, task_lines: str | None
) -> None:
    env = flow.worker_env(flow.environ())
    env.pop("LOG_LEVEL", None)  # the default, INFO
    env.pop("LOG_TASK_LINES", None)
    if task_lines is not None:
        env["LOG_TASK_LINES"] = task_lines
    data = flow.batches("ls")
    total = sum(len(b["items"]) for b in data)
    with flow.simulator(env, tmp_path) as sim:
        env["GATEWAY_URL"] = sim.url
        flow.submit(env, data, tmp_path / "batches.json")
        with flow.celery_worker(env, tmp_path) as worker:
            counts = flow.wait_terminal(total, timeout=120, worker=worker)
    assert counts == {"succeeded": 6, "failed": 2, "dead": 2}, counts
    assert worker.proc.returncode == 0, worker.stderr.read_text()[-3000:]

    lines = flow.json_lines(worker.stderr.read_text())
    # no plain-text banner on stdout either; Celery's signal handler prints (not logs) one
    # notice there when it is told to stop, which is all stdout may hold
    notices = [x for x in worker.stdout.read_text().splitlines() if x.strip()]
    assert notices == ["worker: Warm shutdown (MainProcess)"], notices
    for line in lines:
        assert {"event", "level", "timestamp", "logger"} <= set(line), line
        assert line["level"] in ("debug", "info", "warning", "error", "critical"), line
    events = [str(x["event"]) for x in lines]
    # Celery's own lines, rendered by our processors
    assert any(e.endswith(" ready.") and e.startswith("w1@") for e in events), events[:40]
    # Celery's two lines per message: off by default (LOG_TASK_LINES), every other line kept
    received = [x for x in lines if str(x["event"]).endswith("] received")]
    succeeded = [x for x in lines if "] succeeded in " in str(x["event"])]
    if task_lines is None:
        assert not received and not succeeded, (received + succeeded)[:3]
    else:
        assert received and all(x["logger"] == "celery.worker.strategy" for x in received)
        assert succeeded and all(x["logger"] == "celery.app.trace" for x in succeeded)
    assert any(x["event"] == "worker_starting" for x in lines)

    # item events carry the whole context
    item_events = [x for x in lines if x["event"] in ("item_failed", "item_retry", "dead_letter")]
    kinds = {x["event"] for x in item_events}
    assert kinds == {"item_failed", "item_retry", "dead_letter"}, kinds
    for x in item_events:
        for key in (
            "task_id",
            "batch_id",
            "account_id",
            "transaction_id",
            "attempt",
            "fence_token",
        ):
            assert x.get(key) not in (None, ""), (key, x)
        assert x["transaction_id"].startswith(x["account_id"].replace("-acct-", "-a") + "-")
    dead = [x for x in item_events if x["event"] == "dead_letter"]
    assert {x["reason"] for x in dead} == {"retries_exhausted"}

    # nothing leaks: a task id always goes with the same batch; item fields never outlive
    # their item (account_drained is logged after the items, in the same thread)
    batch_of: dict[str, set[str]] = defaultdict(set)
    for x in lines:
        if "task_id" in x and "batch_id" in x:
            batch_of[x["task_id"]].add(x["batch_id"])
    assert batch_of and all(len(b) == 1 for b in batch_of.values()), batch_of
    drained = [x for x in lines if x["event"] == "account_drained"]
    assert drained
    for x in drained:
        assert "transaction_id" not in x and "attempt" not in x, x
        assert x.get("task_id") and x.get("account_id"), x
    # Celery's lines of the consumer thread carry no task's context
    for x in received:
        assert "transaction_id" not in x and "account_id" not in x, x
