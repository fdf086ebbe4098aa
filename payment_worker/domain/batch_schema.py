"""Pydantic models of the batch JSON, and its validation errors with JSON paths.

One batch is one account's list of payouts::

    {"batch_id": "payout-2026-11-29-0001", "account_id": "acct-42",
     "items": [{"transaction_id": "tx-1", "amount": 150000, "currency": "IDR",
                "beneficiary": {"bank_code": "014", "account_number": "1234567890",
                                "name": "Budi"},
                "description": "optional"}]}

:func:`parse_batch` reports every problem at once, each as ``{"path": "$.items[3].amount",
"message": "..."}``; the two limits that are settings (items per batch, largest amount) come
in as arguments.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from payment_worker.domain.idempotency import fingerprint
from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.errors import PaymentWorkerError

IDENTIFIER_MAX_LENGTH = 128
BANK_CODE_MAX_LENGTH = 32
ACCOUNT_NUMBER_MAX_LENGTH = 64
NAME_MAX_LENGTH = 140
DESCRIPTION_MAX_LENGTH = 255
# deepest nesting of arrays and objects :func:`loads` accepts; a batch file needs 5 (array of
# batches, batch, items, item, beneficiary). Well below Python's recursion limit, so that
# parsing and anything recursive after it (validation, json.dumps) never run out of stack.
MAX_JSON_DEPTH = 32
# longest integer :func:`loads` accepts, in digits: an amount is at most a PostgreSQL bigint (19
# digits), so this refuses nothing a batch can hold, and past Python's own limit (4,300) the
# message would have named ``sys.set_int_max_str_digits`` instead of the input
MAX_INT_DIGITS = 40

_CURRENCY = re.compile(r"[A-Z]{3}")
_IDENT_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# the zero-width non-joiner and joiner: invisible, yet part of how names are spelled in
# Persian, the Indic scripts and others ("محمد‌رضا"), so a name or description may hold them.
# Every other format character stays refused (a bidi override reorders what on-call reads)
_JOINERS = "\u200c\u200d"
_NO_JOINERS = str.maketrans("", "", _JOINERS)


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must contain printable characters only (no control characters)")
    return value


def _text(value: str) -> str:
    """Free text (a name, a description): printable; a joiner only right after a letter or
    a mark, where a script puts it (a Malayalam chillu ends a word with one), never alone
    or after a space or another joiner."""
    _printable(value.translate(_NO_JOINERS))
    for i, ch in enumerate(value):
        if ch in _JOINERS and not (i > 0 and _in_word(value[i - 1])):
            raise ValueError("may hold a zero-width joiner only right after a letter or mark")
    return value


def _in_word(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "LM"


def _identifier(value: str) -> str:
    _printable(value)
    # "tx-1" and "tx-1 " would be two different transactions: refuse the ambiguity
    if value != value.strip():
        raise ValueError("must not start or end with whitespace")
    # so would "tx-é" composed and decomposed (two code point sequences, one text): the same
    # payment sent again by a producer that normalises differently would be paid twice
    if not unicodedata.is_normalized("NFC", value):
        raise ValueError("must be in Unicode normalization form NFC")
    # an account id is a segment of the gateway's URL paths, and "." or ".." there is a dot
    # segment that a proxy or the gateway may resolve to another path (RFC 3986, 5.2.4)
    if value in (".", ".."):
        raise ValueError('must not be "." or ".."')
    return value


def _not_blank(value: str) -> str:
    _printable(value)
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def _name(value: str) -> str:
    _text(value)  # (a joiner follows a letter or mark: a name of joiners and spaces is none)
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def check_identifier(value: str) -> str:
    """``value`` if a batch accepts it as a batch, account or transaction id (1 to
    :data:`IDENTIFIER_MAX_LENGTH` characters, :func:`_identifier`'s rules); ValueError with
    the reason otherwise. For ids named outside a batch (GATEWAY_RATE_OVERRIDES)."""
    if not 1 <= len(value) <= IDENTIFIER_MAX_LENGTH:
        raise ValueError(f"must be 1 to {IDENTIFIER_MAX_LENGTH} characters")
    return _identifier(value)


def _currency(value: str) -> str:
    if not _CURRENCY.fullmatch(value):
        raise ValueError("must be three upper-case letters (ISO 4217), e.g. IDR")
    return value


Identifier = Annotated[
    str,
    StringConstraints(min_length=1, max_length=IDENTIFIER_MAX_LENGTH),
    AfterValidator(_identifier),
]
Currency = Annotated[str, AfterValidator(_currency)]


BankCode = Annotated[
    str,
    StringConstraints(min_length=1, max_length=BANK_CODE_MAX_LENGTH),
    AfterValidator(_not_blank),
]
AccountNumber = Annotated[
    str,
    StringConstraints(min_length=1, max_length=ACCOUNT_NUMBER_MAX_LENGTH),
    AfterValidator(_not_blank),
]
Name = Annotated[
    str, StringConstraints(min_length=1, max_length=NAME_MAX_LENGTH), AfterValidator(_name)
]
Description = Annotated[
    str, StringConstraints(max_length=DESCRIPTION_MAX_LENGTH), AfterValidator(_text)
]


class Beneficiary(BaseModel):
    """Who receives the money."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    bank_code: BankCode
    account_number: AccountNumber
    name: Name


class Item(BaseModel):
    """One payout of a batch."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    transaction_id: Identifier
    # strict: no floats, no booleans, no numeric strings; minor units
    amount: Annotated[int, Field(gt=0)]
    currency: Currency
    beneficiary: Beneficiary
    description: Description | None = None

    @field_validator("amount")
    @classmethod
    def _at_most_max(cls, value: int, info: ValidationInfo) -> int:
        limit = _limit(info, "max_amount")
        if limit is not None and value > limit:
            raise ValueError(f"must be at most {limit} (MAX_AMOUNT)")
        return value


class Batch(BaseModel):
    """One account's batch of payouts."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    batch_id: Identifier
    account_id: Identifier
    items: list[Item]

    @field_validator("items", mode="before")
    @classmethod
    def _item_count(cls, value: Any, info: ValidationInfo) -> Any:
        # checked before the items themselves, so an oversized list costs no item validation
        if isinstance(value, list):
            if not value:
                raise ValueError("must contain at least 1 item")
            limit = _limit(info, "max_items")
            if limit is not None and len(value) > limit:
                raise ValueError(
                    f"must contain at most {limit} items (MAX_ITEMS_PER_BATCH), got {len(value)}"
                )
        return value

    def payment_requests(self) -> list[PaymentRequest]:
        """The items as gateway requests, in batch order."""
        return [
            PaymentRequest(
                account_id=self.account_id,
                transaction_id=item.transaction_id,
                amount=item.amount,
                currency=item.currency,
                beneficiary=dict(item.beneficiary),
                description=item.description,
            )
            for item in self.items
        ]

    def fingerprint(self) -> str:
        """SHA-256 of the batch's canonical content (see :func:`batch_fingerprint`)."""
        return batch_fingerprint(
            self.batch_id,
            self.account_id,
            [(r.transaction_id, r.fingerprint()) for r in self.payment_requests()],
        )


def batch_fingerprint(
    batch_id: str, account_id: str, item_fingerprints: Iterable[tuple[str, str]]
) -> str:
    """SHA-256 of a batch's canonical content, from ``(transaction_id, item fingerprint)`` pairs.

    An item's fingerprint is ``PaymentRequest.fingerprint()``, the SHA-256 of its canonical
    gateway body, so equal fingerprints mean equal bodies. Items are taken in transaction-id
    order (ids are unique within a batch): the same set of payouts sent again in another
    order is the same batch; an absent and a null description are the same, as on the wire.
    """
    return fingerprint(
        {
            "batch_id": batch_id,
            "account_id": account_id,
            "items": sorted(item_fingerprints),
        }
    )


def _limit(info: ValidationInfo, name: str) -> int | None:
    context = info.context
    if isinstance(context, dict):
        value = context.get(name)
        if isinstance(value, int):
            return value
    return None


class InvalidBatch(PaymentWorkerError, ValueError):
    """A batch that failed validation; ``errors`` lists every problem with its JSON path."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors


def json_path(loc: Sequence[int | str]) -> str:
    """A pydantic error location as a JSON path.

    ``("items", 3, "amount")`` becomes ``$.items[3].amount``; an odd key is quoted:
    ``$.items[0]["a b"]``.
    """
    out = ["$"]
    for part in loc:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif _IDENT_KEY.fullmatch(part):
            out.append(f".{part}")
        else:
            out.append(f"[{json.dumps(part, ensure_ascii=False)}]")
    return "".join(out)


def _duplicate_transactions(items: Any) -> list[tuple[int, dict[str, str]]]:
    """Transaction ids seen twice in one batch, found on the raw input so that they are
    reported together with every other error (pydantic would stop before a model check)."""
    found: list[tuple[int, dict[str, str]]] = []
    if not isinstance(items, list):
        return found
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        tx = item.get("transaction_id") if isinstance(item, dict) else None
        if not isinstance(tx, str):
            continue
        if tx in first:
            found.append(
                (
                    index,
                    {
                        "path": f"$.items[{index}].transaction_id",
                        "message": f"duplicate transaction_id {tx!r} "
                        f"(first at $.items[{first[tx]}].transaction_id)",
                    },
                )
            )
        else:
            first[tx] = index
    return found


# pydantic's wording speaks Python ("dictionary", "instance of Item"); producers write JSON
_MESSAGES = {
    "missing": "is required",
    "extra_forbidden": "is not a known field",
    "model_type": "must be a JSON object",
    "dict_type": "must be a JSON object",
    "list_type": "must be a JSON array",
    "string_type": "must be a string",
    "int_type": "must be an integer in minor units (not a float, boolean or string)",
    "string_too_short": "must not be empty",
}


def _item_index(loc: Sequence[int | str]) -> int:
    if len(loc) >= 2 and loc[0] == "items" and isinstance(loc[1], int):
        return loc[1]
    return -1


def parse_batch(data: Any, *, max_items: int, max_amount: int) -> Batch:
    """Validate one batch (already decoded from JSON); raises :class:`InvalidBatch` with all errors.

    Errors are ordered batch fields first, then item by item.
    """
    if not isinstance(data, dict):
        raise InvalidBatch([{"path": "$", "message": "a batch must be a JSON object"}])
    ranked: list[tuple[int, int, dict[str, str]]] = []
    batch: Batch | None = None
    try:
        batch = Batch.model_validate(
            data, context={"max_items": max_items, "max_amount": max_amount}
        )
    except ValidationError as exc:
        for n, detail in enumerate(exc.errors(include_url=False, include_input=False)):
            msg = _MESSAGES.get(detail["type"]) or str(detail["msg"]).removeprefix("Value error, ")
            loc = detail["loc"]
            ranked.append((_item_index(loc), n, {"path": json_path(loc), "message": msg}))
    for index, dup in _duplicate_transactions(data.get("items")):
        ranked.append((index, len(ranked), dup))
    if ranked or batch is None:
        ranked.sort(key=lambda r: (r[0], r[1]))
        raise InvalidBatch([r[2] for r in ranked])
    return batch


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads`: a key twice in one object is an error,
    because ``{"amount": 1, "amount": 1000}`` has no single meaning."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in one JSON object")
        out[key] = value
    return out


class RefusedJSON(PaymentWorkerError, ValueError):
    """Well-formed JSON that :func:`loads` refuses all the same: nested deeper than
    :data:`MAX_JSON_DEPTH`, holding a string that is not Unicode text, or an integer longer
    than :data:`MAX_INT_DIGITS`."""


# everything up to the next bracket outside a string, and that bracket. A string is taken
# whole (to the end of the text when unterminated, as far as the parser would read), so the
# brackets inside it do not count; possessive, so that nothing backtracks
_UP_TO_BRACKET = re.compile(r'(?:[^][{}"]++|"[^"\\]*+(?:\\.[^"\\]*+)*+"?)*+([][{}])', re.DOTALL)
# a surrogate escape, paired or not: where there is none, no string can hold a lone one
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _where(text: str, pos: int) -> str:
    """A position in the words of :class:`json.JSONDecodeError`."""
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"line {line} column {column} (char {pos})"


def check_depth(text: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`RefusedJSON` when the arrays and objects of the JSON value ``text`` starts
    with nest deeper than ``limit``.

    Made before parsing, because the parser recurses once per level (100,000 ``[`` exhaust
    Python's stack); a scan of strings and brackets that neither parses nor recurses. It
    reads as far as the parser would: to the end of the first value, or to a stray closing
    bracket; broken JSON may be refused here before the parser would call it invalid.
    """
    depth = 0
    match = _UP_TO_BRACKET.match(text)
    while match is not None:
        if match.group(1) in "[{":
            depth += 1
            if depth > limit:
                where = _where(text, match.end() - 1)
                raise RefusedJSON(f"JSON nested more than {limit} levels deep: {where}")
        else:
            depth -= 1
            if depth <= 0:  # the first value is closed, or broken: the parser stops here
                return
        match = _UP_TO_BRACKET.match(text, match.end())


def _lone_surrogate(value: Any) -> str | None:
    """Where a decoded JSON value holds a lone surrogate (from an escape such as
    ``"\\ud800"``), or None. Iterative: the value may be as deep as the depth limit allows."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return f"lone surrogate {found.group()!r} in the string at $" if found else None
    containers: list[tuple[Any, tuple[int | str, ...]]] = [(value, ())]
    while containers:
        node, loc = containers.pop()
        children: Iterable[tuple[int | str, Any]]
        if isinstance(node, dict):
            # keys first, so that a path reported below this object is printable
            for key in node:
                found = _SURROGATE.search(key)
                if found:
                    return f"lone surrogate {found.group()!r} in a key of {json_path(loc)}"
            children = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            continue
        for part, child in children:
            # strings checked here, not queued: they are most of a batch
            if isinstance(child, str):
                found = _SURROGATE.search(child)
                if found:
                    where = json_path((*loc, part))
                    return f"lone surrogate {found.group()!r} in the string at {where}"
            elif isinstance(child, dict | list):
                containers.append((child, (*loc, part)))
    return None


def loads(text: str | bytes) -> Any:
    """Decode JSON strictly: duplicate keys, NaN and Infinity are errors (``ValueError``).

    Nesting deeper than :data:`MAX_JSON_DEPTH`, lone surrogates and integers longer than
    :data:`MAX_INT_DIGITS` are refused with :class:`RefusedJSON` (a ``ValueError`` too):
    nothing downstream has to cope with them.
    """

    def _no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    def _int(digits: str) -> int:
        length = len(digits.lstrip("-"))
        if length > MAX_INT_DIGITS:
            raise RefusedJSON(f"a number {length:,} digits long (at most {MAX_INT_DIGITS})")
        return int(digits)

    if isinstance(text, bytes):
        # decoded here, strictly (json.loads would let encoded surrogates through), so that
        # the depth scan reads exactly the text that is parsed
        text = text.decode(json.detect_encoding(text))
    check_depth(text)
    value = json.loads(
        text,
        object_pairs_hook=reject_duplicate_keys,
        parse_constant=_no_constant,
        parse_int=_int,
    )
    # a string with a lone surrogate cannot be written as UTF-8: not to stdout, not to
    # PostgreSQL, not to the gateway. Text read from a file holds no surrogate, so only an
    # escape can make one; the walk is skipped unless there is one of either
    if _SURROGATE_ESCAPE.search(text) or _SURROGATE.search(text):
        problem = _lone_surrogate(value)
        if problem:
            raise RefusedJSON(f"{problem}, which is not Unicode text")
    return value
