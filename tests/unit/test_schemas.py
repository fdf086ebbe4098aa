"""Batch validation: every error at once, each with its JSON path; no services needed."""

from __future__ import annotations

import copy
import json
import unicodedata
from typing import Any

import pytest

from payment_worker.domain.batch_schema import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    InvalidBatch,
    RefusedJSON,
    json_path,
    loads,
    parse_batch,
)
from payment_worker.domain.payment_request import PaymentRequest

LIMITS = {"max_items": 5, "max_amount": 1_000_000}


def item(tx: str = "tx-1", **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "transaction_id": tx,
        "amount": 150_000,
        "currency": "IDR",
        "beneficiary": {"bank_code": "014", "account_number": "1234567890", "name": "Budi"},
    }
    base.update(over)
    return base


def batch(*items: dict[str, Any], **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "batch_id": "payout-2026-11-29-0001",
        "account_id": "acct-42",
        "items": list(items) or [item()],
    }
    base.update(over)
    return base


def errors_of(data: Any, **limits: int) -> list[dict[str, str]]:
    with pytest.raises(InvalidBatch) as info:
        parse_batch(data, **{**LIMITS, **limits})
    return info.value.errors


def paths(data: Any, **limits: int) -> list[str]:
    return [e["path"] for e in errors_of(data, **limits)]


def test_the_documented_example_is_valid() -> None:
    b = parse_batch(batch(item(description="optional")), **LIMITS)
    assert b.batch_id == "payout-2026-11-29-0001"
    assert b.items[0].amount == 150_000
    assert b.items[0].beneficiary.name == "Budi"
    assert b.items[0].description == "optional"


@pytest.mark.parametrize(
    "amount",
    [0, -1, 1.5, 150000.0, True, False, "150000", None, [1], {"v": 1}, 1_000_001],
    ids=repr,
)
def test_amount_must_be_a_positive_integer_within_the_limit(amount: Any) -> None:
    errs = errors_of(batch(item(amount=amount)))
    assert [e["path"] for e in errs] == ["$.items[0].amount"]
    assert errs[0]["message"]


def test_amount_limit_is_the_setting_and_inclusive() -> None:
    assert parse_batch(batch(item(amount=1_000_000)), **LIMITS).items[0].amount == 1_000_000
    errs = errors_of(batch(item(amount=1_000_001)))
    assert "at most 1000000" in errs[0]["message"]


@pytest.mark.parametrize("currency", ["idr", "ID", "IDRX", "1DR", "", 360, None])
def test_currency_is_three_upper_case_letters(currency: Any) -> None:
    assert paths(batch(item(currency=currency))) == ["$.items[0].currency"]


@pytest.mark.parametrize(
    "value",
    # "." and "..": an account id is a segment of the gateway's URL paths (dot segments)
    ["", " lead", "trail ", "tab\there", "nl\n", "x" * 129, 42, None, ["a"], ".", ".."],
    ids=repr,
)
@pytest.mark.parametrize("field", ["batch_id", "account_id"])
def test_identifiers_are_non_empty_printable_bounded_strings(field: str, value: Any) -> None:
    assert paths(batch(**{field: value})) == [f"$.{field}"]


@pytest.mark.parametrize("value", ["", "x" * 129, 7, "a\u0000b", ".."], ids=repr)
def test_transaction_id_is_checked_like_the_other_ids(value: Any) -> None:
    assert paths(batch(item(tx=value))) == ["$.items[0].transaction_id"]


def test_an_identifier_must_be_nfc() -> None:
    """One text in two code point sequences would be two transactions: a producer that sends
    the same payment normalised otherwise would pay it twice."""
    decomposed = unicodedata.normalize("NFD", "tx-café")
    assert decomposed != "tx-café"
    errs = errors_of(batch(item(tx=decomposed), account_id=unicodedata.normalize("NFD", "Å")))
    assert errs == [
        {"path": "$.account_id", "message": "must be in Unicode normalization form NFC"},
        {
            "path": "$.items[0].transaction_id",
            "message": "must be in Unicode normalization form NFC",
        },
    ]
    b = parse_batch(batch(item(tx="tx-café"), account_id="Å"), **LIMITS)
    assert b.items[0].transaction_id == "tx-café"


@pytest.mark.parametrize(
    "name",
    [
        "\u0645\u062d\u0645\u062f\u200c\u0631\u0636\u0627",
        "क्\u200dष",
        "\u0d05\u0d28\u0d4d\u200d\u0d35\u0d30\u0d4d\u200d",
        "Anne-Marie",
    ],
    ids=["zwnj-persian", "zwj-devanagari", "chillu-malayalam", "ascii"],
)
def test_names_and_descriptions_may_hold_the_joiners_their_script_needs(name: str) -> None:
    b = parse_batch(
        batch(item(beneficiary={**item()["beneficiary"], "name": name}, description=name)), **LIMITS
    )
    assert (b.items[0].beneficiary.name, b.items[0].description) == (name, name)


@pytest.mark.parametrize(
    "name",
    ["a\u202eb", "a\u200bb", "\u200c\u200d", "\u200cA", "a \u200db", "a\u200c\u200cb", "a\x00"],
    ids=repr,
)
def test_other_invisible_characters_stay_refused_in_a_name(name: str) -> None:
    # a bidi override (what on-call reads reordered), a zero-width space, joiners alone, at
    # the start, after a space or after another joiner
    errs = errors_of(batch(item(beneficiary={**item()["beneficiary"], "name": name})))
    assert [e["path"] for e in errs] == ["$.items[0].beneficiary.name"]


def test_joiners_stay_refused_in_identifiers() -> None:
    assert paths(batch(item(tx="tx\u200d1"))) == ["$.items[0].transaction_id"]


def test_dots_are_fine_inside_an_identifier() -> None:
    b = parse_batch(batch(item(tx="..tx.1"), account_id="acct.42", batch_id="..."), **LIMITS)
    assert (b.account_id, b.batch_id, b.items[0].transaction_id) == ("acct.42", "...", "..tx.1")


def test_identifier_limits_are_inclusive() -> None:
    b = parse_batch(batch(item(tx="t" * 128), batch_id="b" * 128), **LIMITS)
    assert len(b.items[0].transaction_id) == 128


@pytest.mark.parametrize("field", ["bank_code", "account_number", "name"])
def test_beneficiary_fields_are_required_and_not_blank(field: str) -> None:
    missing = item()
    del missing["beneficiary"][field]
    blank = item()
    blank["beneficiary"][field] = "   "
    assert paths(batch(missing)) == [f"$.items[0].beneficiary.{field}"]
    assert paths(batch(blank)) == [f"$.items[0].beneficiary.{field}"]


def test_unknown_fields_are_reported_not_ignored() -> None:
    extra = item(fee=5)
    extra["beneficiary"]["iban"] = "x"
    assert sorted(paths(batch(extra, priority=1))) == [
        "$.items[0].beneficiary.iban",
        "$.items[0].fee",
        "$.priority",
    ]


def test_item_count_between_one_and_the_setting() -> None:
    assert paths(batch(items=[])) == ["$.items"]
    errs = errors_of(batch(*[item(f"tx-{i}") for i in range(6)]))
    assert [e["path"] for e in errs] == ["$.items"]
    assert "at most 5 items" in errs[0]["message"]
    assert len(parse_batch(batch(*[item(f"tx-{i}") for i in range(5)]), **LIMITS).items) == 5


def test_duplicate_transaction_id_names_both_places() -> None:
    errs = errors_of(batch(item("tx-1"), item("tx-2"), item("tx-1")))
    assert errs == [
        {
            "path": "$.items[2].transaction_id",
            "message": "duplicate transaction_id 'tx-1' (first at $.items[0].transaction_id)",
        }
    ]


def test_every_error_is_reported_at_once_in_document_order() -> None:
    bad = batch(
        item("tx-1", amount=1.5),
        item("tx-1", currency="usd"),
        "not an item",
        item("tx-4", beneficiary={"bank_code": "014"}),
        batch_id="",
    )
    assert paths(bad) == [
        "$.batch_id",
        "$.items[0].amount",
        "$.items[1].currency",
        "$.items[1].transaction_id",
        "$.items[2]",
        "$.items[3].beneficiary.account_number",
        "$.items[3].beneficiary.name",
    ]


@pytest.mark.parametrize("data", [[], "batch", 42, None])
def test_a_batch_must_be_an_object(data: Any) -> None:
    assert errors_of(data) == [{"path": "$", "message": "a batch must be a JSON object"}]


def test_messages_speak_json_not_python() -> None:
    errs = errors_of(batch(items="x", account_id=None))
    by_path = {e["path"]: e["message"] for e in errs}
    assert by_path == {"$.account_id": "must be a string", "$.items": "must be a JSON array"}


def test_json_path_quotes_odd_keys() -> None:
    assert json_path(("items", 3, "amount")) == "$.items[3].amount"
    assert json_path(("items", 0, "a b")) == '$.items[0]["a b"]'
    assert json_path(()) == "$"


def test_fingerprint_ignores_item_order_and_absent_vs_null_description() -> None:
    a = parse_batch(batch(item("tx-1"), item("tx-2", description=None)), **LIMITS)
    b = parse_batch(batch(item("tx-2"), item("tx-1")), **LIMITS)
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["items"][0].update(amount=150_001),
        lambda b: b["items"][0]["beneficiary"].update(name="Budi S"),
        lambda b: b["items"][0].update(description="other"),
        lambda b: b.update(account_id="acct-43"),
        lambda b: b["items"].append(item("tx-9")),
    ],
)
def test_fingerprint_changes_with_any_content(change: Any) -> None:
    original = batch(item("tx-1"), item("tx-2"))
    changed = copy.deepcopy(original)
    change(changed)
    assert (
        parse_batch(original, **LIMITS).fingerprint()
        != parse_batch(changed, **LIMITS).fingerprint()
    )


def test_payment_requests_match_the_gateway_body() -> None:
    b = parse_batch(batch(item("tx-1", description="d")), **LIMITS)
    (req,) = b.payment_requests()
    assert req == PaymentRequest(
        account_id="acct-42",
        transaction_id="tx-1",
        amount=150_000,
        currency="IDR",
        beneficiary={"bank_code": "014", "account_number": "1234567890", "name": "Budi"},
        description="d",
    )


@pytest.mark.parametrize(
    "text",
    ['{"a": 1, "a": 2}', '{"amount": NaN}', '{"amount": Infinity}', "{", ""],
)
def test_loads_is_strict(text: str) -> None:
    with pytest.raises(ValueError):
        loads(text)


def test_loads_accepts_plain_json() -> None:
    assert loads(b'{"items": [1, 2]}') == {"items": [1, 2]}


def test_loads_refuses_a_huge_integer_by_its_length() -> None:
    """Past Python's 4,300 digits the message named ``sys.set_int_max_str_digits``; an
    amount has at most 19 digits, so 40 refuses nothing a batch can hold."""
    assert loads('{"amount": -%s}' % ("9" * MAX_INT_DIGITS)) == {
        "amount": -int("9" * MAX_INT_DIGITS)
    }
    for digits in (MAX_INT_DIGITS + 1, 5_000):
        with pytest.raises(RefusedJSON) as info:
            loads('{"amount": %s}' % ("1" * digits))
        assert str(info.value) == f"a number {digits:,} digits long (at most {MAX_INT_DIGITS})"


# 100,000 levels: far past Python's recursion limit, the input that used to crash the CLI
DEEP = 100_000


def deep_value(depth: int = DEEP) -> Any:
    """A Python value ``depth`` lists deep, built without recursion."""
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "text",
    [
        "[" * DEEP,
        "[" * DEEP + "]" * DEEP,
        '{"a":' * DEEP,
        '{"a":' * DEEP + "1" + "}" * DEEP,
        '[{"a":' * DEEP,
        b"[" * DEEP,
    ],
    ids=["arrays", "closed arrays", "objects", "closed objects", "mixed", "bytes"],
)
def test_loads_refuses_deep_nesting_without_recursing(text: str | bytes) -> None:
    with pytest.raises(RefusedJSON) as info:
        loads(text)
    assert str(info.value).startswith(f"JSON nested more than {MAX_JSON_DEPTH} levels deep: ")
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still cope


def test_depth_limit_is_inclusive_and_names_where() -> None:
    for text in (
        "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH,
        '{"a":' * MAX_JSON_DEPTH + "1" + "}" * MAX_JSON_DEPTH,
    ):
        assert loads(text) == json.loads(text)
    # the 33rd bracket: after a newline and a space
    with pytest.raises(RefusedJSON, match=r": line 2 column 34 \(char 34\)$"):
        loads("\n " + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))


def test_brackets_inside_strings_do_not_count() -> None:
    many = "[{" * DEEP
    assert loads(f'["{many}"]') == [many]
    assert loads(f'["\\"{many}", "\\\\"]') == [f'"{many}', "\\"]
    # an escaped backslash does not escape the quote after it: these brackets are outside
    with pytest.raises(RefusedJSON):
        loads('["\\\\", ' + "[" * DEEP)


def test_the_depth_scan_reads_no_further_than_the_parser() -> None:
    # the parser stops after the first value ("Extra data"), as JSON lines are read line by
    # line: a deep second value is for the line-by-line read to refuse
    with pytest.raises(ValueError) as info:
        loads("{}\n" + "[" * DEEP)
    assert not isinstance(info.value, RefusedJSON)
    assert "Extra data" in str(info.value)


def test_deep_nesting_inside_a_batch_is_refused_where_it_is() -> None:
    text = json.dumps(batch(item(description="@"))).replace('"@"', "[" * DEEP + "]" * DEEP)
    column = text.index("[[") + MAX_JSON_DEPTH - 3 + 1  # batch, items, item: 3 levels above
    with pytest.raises(RefusedJSON, match=rf"line 1 column {column} "):
        loads(text)


def test_nesting_within_the_limit_is_a_validation_error_with_its_path() -> None:
    name = deep_value(20)
    data = loads(
        json.dumps(batch(item(beneficiary={"bank_code": "1", "account_number": "2", "name": name})))
    )
    assert errors_of(data) == [
        {"path": "$.items[0].beneficiary.name", "message": "must be a string"}
    ]


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("description", ["$.items[0].description"]),
        ("beneficiary", ["$.items[0].beneficiary"]),
        ("beneficiary.name", ["$.items[0].beneficiary.name"]),
        ("beneficiary.extra", ["$.items[0].beneficiary.extra"]),
        ("extra", ["$.items[0].extra"]),
        ("items", ["$.items[0]"]),
    ],
)
def test_deep_python_values_are_validation_errors_not_recursion(
    where: str, expected: list[str]
) -> None:
    # submit_batch takes decoded values too, which no JSON depth limit has seen: validation
    # must reject them without walking into them
    data = batch(item())
    if where == "items":
        data["items"] = deep_value()
    elif where.startswith("beneficiary."):
        data["items"][0]["beneficiary"][where.split(".")[1]] = deep_value()
    else:
        data["items"][0][where] = deep_value()
    assert paths(data) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"batch_id": "\\ud800"}', "lone surrogate '\\ud800' in the string at $.batch_id"),
        ('{"a": [{"\\udfff": 1}]}', "lone surrogate '\\udfff' in a key of $.a[0]"),
        ('["ok", "x\\ud83d"]', "lone surrogate '\\ud83d' in the string at $[1]"),
        ('"\\ude00\\ud83d"', "lone surrogate '\\ude00' in the string at $"),
        ('{"raw": "\ud800"}', "lone surrogate '\\ud800' in the string at $.raw"),
    ],
)
def test_loads_refuses_lone_surrogates(text: str, problem: str) -> None:
    # such a string cannot be encoded as UTF-8: not printed, not stored, not sent
    with pytest.raises(RefusedJSON) as info:
        loads(text)
    assert str(info.value) == f"{problem}, which is not Unicode text"


def test_loads_keeps_surrogate_pairs_and_refuses_encoded_surrogates() -> None:
    assert loads('["\\ud83d\\ude00", "\\u00e9"]') == ["\U0001f600", "é"]
    assert loads('"é"'.encode("utf-16")) == "é"
    with pytest.raises(ValueError):
        loads(b'"\xed\xa0\x80"')  # a surrogate encoded as UTF-8 is not UTF-8
