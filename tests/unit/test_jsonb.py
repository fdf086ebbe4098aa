"""payment_worker.db.jsonb: a document Postgres's jsonb takes, its NULs replaced."""

from __future__ import annotations

import json

from payment_worker.db import jsonb


def test_each_nul_in_any_string_becomes_the_replacement_character() -> None:
    value = {"error": "a\x00b", "args": ["\x00", {"k\x00": "\x00\x00"}], "n": 1}
    assert json.loads(jsonb.dumps(value)) == {
        "error": "a\ufffdb",
        "args": ["\ufffd", {"k\ufffd": "\ufffd\ufffd"}],
        "n": 1,
    }


def test_the_text_backslash_u0000_is_kept_as_it_is() -> None:
    # a literal backslash before "u0000" is not an escape: Postgres takes it
    for text in ("\\u0000", "\\\\u0000", "x\\\x00"):
        assert json.loads(jsonb.dumps(text)) == text.replace("\x00", "\ufffd")


def test_a_document_without_nul_is_json_dumps_own() -> None:
    value = {"a": [1, 2.5, None, "é"], "b": "\\"}
    assert jsonb.dumps(value, default=repr) == json.dumps(value, default=repr)
