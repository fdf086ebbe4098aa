"""``payment-worker submit`` input refused before any service is touched: one line on
stderr, exit code 2, no traceback, nothing submitted. No services needed."""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from typing import Any

import pytest

from payment_worker.cli import submit as submit_cli
from payment_worker.cli.common import Context
from payment_worker.cli.submit import InputError, iter_documents
from payment_worker.domain.batch_schema import MAX_JSON_DEPTH
from payment_worker.producer import submit as producer
from payment_worker.producer.submit import submit_batch
from payment_worker.runtime import Runtime, ServiceUrls
from payment_worker.settings import Settings
from tests.unit.test_schemas import DEEP, batch, deep_value, item

# nothing listens there: a refused input must never reach a server
_NOWHERE = ServiceUrls(
    "postgresql://127.0.0.1:1/none", "redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0"
)
NO_RUNTIME = Runtime(Settings(), _NOWHERE)

Run = Callable[[str], tuple[int, str, str]]
TOO_DEEP = f"JSON nested more than {MAX_JSON_DEPTH} levels deep: line "


def with_deep(field: str, deep_json: str) -> str:
    """The JSON text of a valid batch whose item field ``field`` (``beneficiary.name`` for a
    beneficiary's field) holds ``deep_json``."""
    data = batch(item())
    target = data["items"][0]
    if field.startswith("beneficiary."):
        target, field = target["beneficiary"], field.split(".")[1]
    target[field] = "@deep@"
    return json.dumps(data, indent=2).replace('"@deep@"', deep_json)


ARRAYS = "[" * DEEP + "]" * DEEP
OBJECTS = '{"a":' * DEEP + "1" + "}" * DEEP

REFUSED_INPUTS = {
    "deep arrays": "[" * DEEP,
    "deep closed arrays": ARRAYS,
    "deep objects": '{"a":' * DEEP,
    "deep closed objects": OBJECTS,
    "deep mixed": '[{"a":' * DEEP,
    "deep beneficiary": with_deep("beneficiary", OBJECTS),
    "deep beneficiary name": with_deep("beneficiary.name", ARRAYS),
    "deep description": with_deep("description", ARRAYS),
    "deep in the second batch": json.dumps([batch(item())])[:-1]
    + ", "
    + with_deep("description", OBJECTS)
    + "]",
    "deep on one line": json.dumps(batch(item(description="@deep@"))).replace('"@deep@"', ARRAYS),
}


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """``payment-worker submit -`` in this process on the given stdin: (exit code, stdout,
    stderr)."""

    def never_submitted(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a refused input reached submission")

    monkeypatch.setattr(producer, "submit_one", never_submitted)

    def run(text: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
        rc = submit_cli.submit(argparse.Namespace(file="-"), Context(Settings(), NO_RUNTIME))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.mark.parametrize("text", REFUSED_INPUTS.values(), ids=REFUSED_INPUTS.keys())
def test_deep_nesting_is_one_line_on_stderr_and_exit_2(run_cli: Run, text: str) -> None:
    rc, out, err = run_cli(text)
    assert rc == 2
    assert out == ""
    assert err.splitlines() == [err.rstrip("\n")]
    assert err.startswith(f"payment-worker submit: input is refused: {TOO_DEEP}")


def test_a_lone_surrogate_is_one_line_on_stderr_and_exit_2(run_cli: Run) -> None:
    text = json.dumps(batch(item(description="@"))).replace('"@"', '"\\udc80"')
    rc, out, err = run_cli(text)
    assert (rc, out) == (2, "")
    assert err == (
        "payment-worker submit: input is refused: lone surrogate '\\udc80' in the string at "
        "$.items[0].description, which is not Unicode text\n"
    )


def test_a_deep_json_line_is_refused_alone() -> None:
    text = json.dumps(batch(item())) + "\n" + "[" * DEEP + "\n" + '{"a":' * DEEP
    first, second, third = iter_documents(text)
    assert first == batch(item())
    assert isinstance(second, InputError)
    assert str(second).startswith(f"line 2 is refused: {TOO_DEEP}1 column ")
    assert isinstance(third, InputError)
    assert str(third).startswith(f"line 3 is refused: {TOO_DEEP}1 column ")


def test_closed_stdin_is_an_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # what Python makes of ``payment-worker submit - <&-``
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(InputError, match="standard input is closed"):
        submit_cli._read("-")


@pytest.mark.parametrize(
    "raw",
    [ARRAYS, ARRAYS.encode(), with_deep("beneficiary", OBJECTS)],
    ids=["text", "bytes", "beneficiary"],
)
def test_submit_batch_rejects_deep_json_text(raw: str | bytes) -> None:
    result = submit_batch(raw, runtime=NO_RUNTIME, enqueue=False)
    assert result.status == "rejected"
    [error] = result.errors
    assert error["path"] == "$"
    assert error["message"].startswith(TOO_DEEP)


def test_submit_batch_rejects_a_deep_decoded_value_with_its_path() -> None:
    data = batch(item(description=deep_value()))
    result = submit_batch(data, runtime=NO_RUNTIME, enqueue=False)
    assert result.status == "rejected"
    assert result.errors == [{"path": "$.items[0].description", "message": "must be a string"}]
