"""Pins the Idempotency-Key derivation to literal values.

Keys are stored at submission and resent on every attempt: a changed recipe would give an
item already sent (or in doubt) a new key, and the gateway would pay it a second time. So the
expected values are written out here, not recomputed with the recipe under test.
Recipe (domain/idempotency.py): ``"pw1-" + sha256(f"{len(account)}:{account}:{tx}")``, where
``len`` counts code points and the text is UTF-8.
"""

from __future__ import annotations

import string
import unicodedata

import pytest

from payment_worker.domain.idempotency import idempotency_key
from payment_worker.domain.payment_request import PaymentRequest

PINNED = [
    ("acct-42", "tx-1", "pw1-b982c9b265c4d527576c2e77cced28977c1570f84db97a063acffd502bb37e1a"),
    # the separator inside the ids must not make two transactions share a key
    ("a-b", "c", "pw1-7ddde0f3a87bc93bae38314f138372f1f9283173e9302dda33b54a4318745b6a"),
    ("a", "b-c", "pw1-1de3cbc6f94bb97618167070735c3171f4c74c12ecd75d787bde96293e864a4a"),
    ("a:b", "c", "pw1-cb600fd6a0198fd3e7d5672901f579267414ef02ddcbb807d55a4eb4ffcfd7ee"),
    ("a", "b:c", "pw1-f6ef836b3dd58acb2e6c16859337d15a35dec9ed61670d2d42d887cee737505d"),
    # unicode ids: the length prefix counts code points, the hash reads UTF-8
    ("账户", "交易-1", "pw1-418a5cee3d6d4ddbde2abdf8a1ed48bd682aba90b2faa60a74fc6e5f2d0b7846"),
    ("café", "tx-é", "pw1-55da3cd294c7140c69e6fc4c60c503f46c0b8d73f1f8f1c72c568f81b0324f76"),
    ("acct-😀", "tx", "pw1-8e9206071038e366a6f8f38630c70f8265eaef35747f7616f89403b7223d7f11"),
    # no normalisation: the decomposed "café" (5 code points) is another account
    (
        unicodedata.normalize("NFD", "café"),
        "tx-é",
        "pw1-47c9e0627483b608f91547bc01dbee91af1e7ab6815e5ad91161f6bdbb02ea1d",
    ),
    # longest ids the producer accepts (128 characters each)
    ("a" * 128, "t" * 128, "pw1-dd53aa67acc74c51cc578f5478aeebdd3c1c6156244010e2b13ee81cd2fc7108"),
]


@pytest.mark.parametrize(("account", "tx", "expected"), PINNED)
def test_idempotency_key_is_pinned(account: str, tx: str, expected: str) -> None:
    assert idempotency_key(account, tx) == expected
    # the request object sends the same key (one derivation, not two)
    beneficiary = {"bank_code": "014", "account_number": "1", "name": "B"}
    assert PaymentRequest(account, tx, 1, "IDR", beneficiary).idempotency_key == expected


def test_separator_in_ids_never_collides() -> None:
    assert idempotency_key("a-b", "c") != idempotency_key("a", "b-c")
    assert idempotency_key("a:b", "c") != idempotency_key("a", "b:c")
    assert idempotency_key("1:a", "b") != idempotency_key("1", "a:b")


@pytest.mark.parametrize(("account", "tx", "_expected"), PINNED)
def test_idempotency_key_is_68_printable_ascii(account: str, tx: str, _expected: str) -> None:
    key = idempotency_key(account, tx)
    assert len(key) == 68
    assert key.isascii() and all(c in string.printable and not c.isspace() for c in key)
    assert key.startswith("pw1-") and set(key[4:]) <= set("0123456789abcdef")
