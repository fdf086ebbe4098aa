"""What a gateway answer means for the worker: the classification table of the protocol.

Every answer (an HTTP status, or a transport failure) maps to exactly one :class:`Outcome`.
The tables below are the single place where that mapping lives; they follow
``docs/gateway-protocol.md`` row by row. Anything the page does not list is treated as
"maybe sent" (UNKNOWN), because only a lookup can prove a payment was not applied.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Any, Protocol

import httpx

from payment_worker.ops.redaction import mask_account_numbers, redact


class HeaderLookup(Protocol):
    """What the tables read of an answer's headers: a field by name, in any case (an
    ``httpx.Headers``, or the connection's own lighter ``Headers``)."""

    def get(self, name: str, default: None = None, /) -> str | None:
        """The field called ``name``, or None."""
        ...


class Outcome(StrEnum):
    """What the worker should do with a transaction after one gateway answer."""

    # 201 / 200 replay with a payment body; lookup 200 whose stored answer is such a 201
    SUCCEEDED = "succeeded"
    DECLINED = "declined"  # 402 (final); lookup 200 whose stored http_status is 402
    PERMANENT = "permanent"  # 400: malformed, nothing applied
    CONFLICT = "conflict"  # 422: the gateway holds an answer under this key; look it up
    RETRY = "retry"  # not applied: 401 (after one refresh), 429, 503, nothing sent
    # maybe sent: 409 (a request with this key is still being processed), a 2xx without a
    # payment body, read timeout, reset after sending, 500, 502, 504, anything unlisted
    UNKNOWN = "unknown"
    NOT_FOUND = "not_found"  # lookup 404 (the protocol's): never applied, or key forgotten
    IN_FLIGHT = "in_flight"  # lookup 409


@dataclass(frozen=True, slots=True)
class GatewayResult:
    """One classified gateway answer."""

    outcome: Outcome
    http_status: int | None  # None when no HTTP answer
    payment_id: str | None = None
    reason: str | None = None  # decline reason, the protocol's "error" code, or a transport kind
    retry_after: float | None = None  # seconds, from Retry-After on 429
    replayed: bool = False  # Idempotent-Replayed: true
    error: str | None = None  # short human text for last_error
    # False when nothing reached the gateway (no token, pacing, connection refused, Redis
    # down): such a result uses up no attempt and no lookup
    sent: bool = True
    # a lookup 200's body: the stored answer (transaction_id, amount, currency...)
    stored: dict[str, Any] | None = None

    @property
    def error_class(self) -> str:
        """A short, bounded label of what went wrong, e.g. ``http_503`` or ``timeout``."""
        if self.outcome is Outcome.DECLINED:
            return f"declined:{self.reason or 'unspecified'}"
        if self.http_status is None:
            return self.reason or "transport_error"
        return f"http_{self.http_status}"


# --- the tables ---------------------------------------------------------------------------
# POST /v1/accounts/{account_id}/payments
CREATE_TABLE: dict[int, Outcome] = {
    201: Outcome.SUCCEEDED,
    200: Outcome.SUCCEEDED,  # replay of a stored 201
    402: Outcome.DECLINED,
    400: Outcome.PERMANENT,
    401: Outcome.RETRY,  # the client refreshes once and retries before returning this
    409: Outcome.UNKNOWN,  # still being processed: it may still pay
    422: Outcome.CONFLICT,
    429: Outcome.RETRY,
    500: Outcome.UNKNOWN,
    502: Outcome.UNKNOWN,
    503: Outcome.RETRY,  # the protocol: nothing was applied
    504: Outcome.UNKNOWN,
}

# GET /v1/accounts/{account_id}/payments/{idempotency_key}; a 200 is classified by the
# stored answer's "http_status" (LOOKUP_STORED_TABLE)
LOOKUP_TABLE: dict[int, Outcome] = {
    404: Outcome.NOT_FOUND,
    409: Outcome.IN_FLIGHT,
    400: Outcome.PERMANENT,
    401: Outcome.RETRY,
    429: Outcome.RETRY,
    500: Outcome.UNKNOWN,
    502: Outcome.UNKNOWN,
    503: Outcome.RETRY,
    504: Outcome.UNKNOWN,
}
LOOKUP_STORED_TABLE: dict[int, Outcome] = {201: Outcome.SUCCEEDED, 402: Outcome.DECLINED}

# Transport failures, by the httpx exception class (the first matching base class wins).
# Connect errors and pool timeouts happen before a single byte of the request was sent.
# The first three never reached the gateway (``sent`` is False).
TRANSPORT_TABLE: tuple[tuple[type[httpx.TransportError], Outcome, str], ...] = (
    (httpx.ConnectTimeout, Outcome.RETRY, "connect_timeout"),
    (httpx.ConnectError, Outcome.RETRY, "connect_error"),
    (httpx.PoolTimeout, Outcome.RETRY, "pool_timeout"),
    (httpx.ReadTimeout, Outcome.UNKNOWN, "timeout"),
    (httpx.WriteTimeout, Outcome.UNKNOWN, "timeout"),
    (httpx.RemoteProtocolError, Outcome.UNKNOWN, "reset"),
    (httpx.ReadError, Outcome.UNKNOWN, "reset"),
    (httpx.WriteError, Outcome.UNKNOWN, "reset"),
)
DEFAULT_RETRY_AFTER = 1.0  # seconds, when a 429 carries no usable Retry-After
_MAX_ERROR_TEXT = 300


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(seconds) or math.isinf(seconds):
        return None
    return max(0.0, seconds)


def _json_body(content: bytes) -> dict[str, Any]:
    try:
        data = json.loads(content) if content else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _text(content: bytes) -> str:
    """A body as error text: masked (account numbers, URL passwords) before it is cut, so a
    number cut in half is still masked."""
    return _short(content[: _MAX_ERROR_TEXT + 64].decode("utf-8", "replace"))


def _short(text: str) -> str:
    """Error text to keep (stored, logged, shown): masked, then at most 300 characters."""
    return redact(text)[:_MAX_ERROR_TEXT]


def held_text(found: GatewayResult) -> str | None:
    """What a lookup found stored under a key, as masked error text (a 422's conflict)."""
    if found.stored is None:
        return found.error
    return _short(json.dumps(found.stored, ensure_ascii=False, default=str))


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def is_payment_body(body: dict[str, Any]) -> bool:
    """A stored or returned 201 body of the protocol: a payment id and status succeeded.

    Anything else under a 2xx (a proxy's HTML page, an empty body) proves nothing: the
    payment may or may not have been made, so it is "maybe sent", never "succeeded".
    """
    payment_id = body.get("payment_id")
    return isinstance(payment_id, str) and bool(payment_id) and body.get("status") == "succeeded"


# Create answers that say "nothing applied" or "final", trusted only with the protocol's
# body: the same status from a proxy or a load balancer (an HTML 503 after the request was
# forwarded, a stray 400) proves nothing, so the payment may have been made.
_PROTOCOL_ERRORS: dict[int, str | None] = {
    400: None,  # {"error": "invalid_request", ...}; any error text is the gateway's
    402: "declined",
    503: None,
}


def _is_protocol_error(status: int, body: dict[str, Any]) -> bool:
    """Whether ``body`` is the protocol's error body for ``status`` (see _PROTOCOL_ERRORS)."""
    error = body.get("error")
    expected = _PROTOCOL_ERRORS[status]
    return isinstance(error, str) and bool(error) and expected in (None, error)


def classify_create(status: int, headers: HeaderLookup, content: bytes) -> GatewayResult:
    """Classify the answer to a create-payment request."""
    body = _json_body(content)
    outcome = CREATE_TABLE.get(status, Outcome.UNKNOWN)
    # a success without a payment body, a "nothing applied" without the gateway's body
    unproven = (
        not is_payment_body(body)
        if outcome is Outcome.SUCCEEDED
        else status in _PROTOCOL_ERRORS and not _is_protocol_error(status, body)
    )
    return _result(Outcome.UNKNOWN if unproven else outcome, status, headers, body, content)


def classify_lookup(status: int, headers: HeaderLookup, content: bytes) -> GatewayResult:
    """Classify the answer to a lookup; a 200 is judged by the stored ``http_status``."""
    body = _json_body(content)
    if status == 200:
        stored = body.get("http_status")
        outcome = (
            LOOKUP_STORED_TABLE.get(stored, Outcome.UNKNOWN)
            if isinstance(stored, int)
            else Outcome.UNKNOWN
        )
        if outcome is Outcome.SUCCEEDED and not is_payment_body(body):
            outcome = Outcome.UNKNOWN
        return replace(_result(outcome, status, headers, body, content), stored=body)
    elif status == 404 and body.get("error") != "not_found":
        # a 404 that is not the protocol's (a wrong URL, a proxy) proves nothing
        outcome = Outcome.UNKNOWN
    else:
        outcome = LOOKUP_TABLE.get(status, Outcome.UNKNOWN)
    return _result(outcome, status, headers, body, content)


def _result(
    outcome: Outcome,
    status: int,
    headers: HeaderLookup,
    body: dict[str, Any],
    content: bytes,
) -> GatewayResult:
    reason = _str_or_none(body.get("reason")) if outcome is Outcome.DECLINED else None
    if reason is None:
        reason = _str_or_none(body.get("error"))
    if reason is not None:
        reason = mask_account_numbers(reason[:100])
    retry_after: float | None = None
    if status == 429:
        retry_after = parse_retry_after(headers.get("retry-after"))
        if retry_after is None:
            retry_after = DEFAULT_RETRY_AFTER
    # a decline's body is kept too (its reason, and what the gateway says about it)
    good = outcome is Outcome.SUCCEEDED
    return GatewayResult(
        outcome=outcome,
        http_status=status,
        payment_id=_str_or_none(body.get("payment_id")),
        reason=reason,
        retry_after=retry_after,
        replayed=(headers.get("idempotent-replayed") or "").strip().lower() == "true",
        error=None if good else f"HTTP {status}: {_text(content)}".strip(),
    )


def classify_transport_error(exc: httpx.TransportError) -> GatewayResult:
    """Classify a request that got no HTTP answer."""
    outcome, reason = next(
        ((o, r) for kind, o, r in TRANSPORT_TABLE if isinstance(exc, kind)),
        (Outcome.UNKNOWN, "transport_error"),
    )
    text = _short(f"{type(exc).__name__}: {exc}")
    sent = reason not in ("connect_timeout", "connect_error", "pool_timeout")
    return GatewayResult(outcome=outcome, http_status=None, reason=reason, error=text, sent=sent)


def client_error(exc: Exception) -> GatewayResult:
    """A request that failed inside the client after it may have left (a body that does not
    decode, an unexpected error in the HTTP stack): maybe sent."""
    text = _short(f"{type(exc).__name__}: {exc}")
    return GatewayResult(Outcome.UNKNOWN, http_status=None, reason="client_error", error=text)


#: the reason of a not-sent result held back by the account's pacing: its slot, or a 429's
#: cooldown (a token request's included)
PACED = "paced"
#: the reason of a not-sent result whose shared state (token, pacing) Redis could not give
REDIS_ERROR = "redis_error"


def not_sent(reason: str, error: str, retry_after: float | None = None) -> GatewayResult:
    """A request the client did not send (no token, pacing wait too long, Redis down): safe to
    retry, and it uses up no attempt."""
    return GatewayResult(
        outcome=Outcome.RETRY,
        http_status=None,
        reason=reason,
        retry_after=retry_after,
        error=error[:_MAX_ERROR_TEXT],
        sent=False,
    )
