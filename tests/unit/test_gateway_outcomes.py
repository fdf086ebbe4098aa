"""The classification table, row by row against shared/gateway-protocol.md."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from payment_worker.gateway.outcomes import (
    CREATE_TABLE,
    GatewayResult,
    Outcome,
    classify_create,
    classify_lookup,
    classify_transport_error,
    parse_retry_after,
)

PAID = {"payment_id": "pay_1", "status": "succeeded", "transaction_id": "tx-1", "amount": 5}


def _h(**headers: str) -> httpx.Headers:
    return httpx.Headers({k.replace("_", "-"): v for k, v in headers.items()})


def _b(body: object) -> bytes:
    return json.dumps(body).encode()


# --- create: one test per row of the create table -------------------------------------------
def test_create_201_money_sent_is_succeeded() -> None:
    r = classify_create(201, _h(), _b(PAID))
    assert (r.outcome, r.payment_id, r.replayed, r.error) == (
        Outcome.SUCCEEDED,
        "pay_1",
        False,
        None,
    )


def test_create_200_replay_is_succeeded_and_marked_replayed() -> None:
    r = classify_create(200, _h(Idempotent_Replayed="true"), _b(PAID))
    assert (r.outcome, r.payment_id, r.replayed) == (Outcome.SUCCEEDED, "pay_1", True)


@pytest.mark.parametrize("reason", ["insufficient_funds", "beneficiary_blocked"])
def test_create_402_is_declined_with_reason(reason: str) -> None:
    r = classify_create(402, _h(), _b({"error": "declined", "reason": reason}))
    assert (r.outcome, r.reason, r.error_class) == (
        Outcome.DECLINED,
        reason,
        f"declined:{reason}",
    )


def test_create_402_replayed_keeps_the_decline() -> None:
    body = _b({"error": "declined", "reason": "insufficient_funds"})
    r = classify_create(402, _h(Idempotent_Replayed="true"), body)
    assert (r.outcome, r.replayed) == (Outcome.DECLINED, True)


def test_create_400_is_permanent() -> None:
    r = classify_create(400, _h(), _b({"error": "invalid_request", "detail": "missing key"}))
    assert (r.outcome, r.reason, r.error_class) == (
        Outcome.PERMANENT,
        "invalid_request",
        "http_400",
    )
    assert r.error is not None and "missing key" in r.error


def test_create_401_is_retry() -> None:
    r = classify_create(401, _h(), _b({"error": "invalid_token"}))
    assert (r.outcome, r.reason) == (Outcome.RETRY, "invalid_token")


def test_create_409_is_maybe_sent() -> None:
    # a request with this key is still being processed: it may still pay
    r = classify_create(409, _h(), _b({"error": "idempotency_key_in_use"}))
    assert (r.outcome, r.reason, r.sent) == (Outcome.UNKNOWN, "idempotency_key_in_use", True)


def test_create_422_is_a_conflict_to_look_up() -> None:
    # the gateway holds an answer under this key: never "failed" without looking
    r = classify_create(422, _h(), _b({"error": "idempotency_key_reused"}))
    assert (r.outcome, r.reason) == (Outcome.CONFLICT, "idempotency_key_reused")


@pytest.mark.parametrize(
    ("status", "headers", "content"),
    [
        (200, {"Content-Type": "text/html"}, b"<html><body>OK</body></html>"),
        (201, {}, b""),
        (201, {}, _b({"status": "succeeded"})),  # no payment id
        (201, {}, _b({"payment_id": "", "status": "succeeded"})),
        (201, {}, _b({"payment_id": "p1", "status": "pending"})),
        (200, {"Idempotent-Replayed": "true"}, _b(["not", "an", "object"])),
        (202, {}, _b(PAID)),
        (204, {}, b""),
    ],
)
def test_a_2xx_without_a_payment_body_is_maybe_sent(
    status: int, headers: dict[str, str], content: bytes
) -> None:
    r = classify_create(status, httpx.Headers(headers), content)
    assert r.outcome is Outcome.UNKNOWN


def test_a_lookup_of_a_stored_201_without_a_payment_body_is_unknown() -> None:
    r = classify_lookup(200, _h(), _b({"http_status": 201, "status": "succeeded"}))
    assert r.outcome is Outcome.UNKNOWN


def test_a_lookup_200_keeps_what_the_gateway_stored() -> None:
    r = classify_lookup(200, _h(), _b({**PAID, "http_status": 201}))
    assert r.stored is not None and r.stored["payment_id"] == "pay_1"


@pytest.mark.parametrize(
    ("exc", "sent"),
    [
        (httpx.ConnectError("refused"), False),
        (httpx.ConnectTimeout("slow"), False),
        (httpx.PoolTimeout("full"), False),
        (httpx.ReadTimeout("late"), True),
        (httpx.RemoteProtocolError("reset"), True),
    ],
)
def test_only_requests_that_may_have_left_count_as_sent(exc: Exception, sent: bool) -> None:
    from payment_worker.gateway.outcomes import classify_transport_error

    assert classify_transport_error(exc).sent is sent  # type: ignore[arg-type]


def test_create_429_is_retry_with_retry_after() -> None:
    r = classify_create(429, _h(Retry_After="2"), _b({"error": "rate_limited"}))
    assert (r.outcome, r.retry_after, r.error_class) == (Outcome.RETRY, 2.0, "http_429")


def test_create_429_without_retry_after_waits_a_default_second() -> None:
    r = classify_create(429, _h(), _b({"error": "rate_limited"}))
    assert r.outcome is Outcome.RETRY and r.retry_after == 1.0


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(500, Outcome.UNKNOWN), (502, Outcome.UNKNOWN), (503, Outcome.RETRY)],
)
def test_create_5xx_row(status: int, outcome: Outcome) -> None:
    # the protocol: for 503 nothing was applied, for 500/502 the outcome is unknown
    r = classify_create(status, _h(), _b({"error": "boom"}))
    assert (r.outcome, r.error_class) == (outcome, f"http_{status}")


@pytest.mark.parametrize(
    ("status", "content"),
    [
        (503, b"<html>upstream connect error or disconnect/reset before headers</html>"),
        (503, b""),
        (503, _b({"message": "no error field"})),
        (400, b"Bad Request"),
        (400, _b({"error": ""})),
        (402, b""),
        (402, _b({"error": "payment_required"})),  # not the protocol's decline
    ],
)
def test_a_not_applied_or_final_status_without_the_protocol_body_is_maybe_sent(
    status: int, content: bytes
) -> None:
    # a proxy's answer may come after the request was forwarded: it proves nothing
    r = classify_create(status, _h(), content)
    assert (r.outcome, r.http_status, r.sent) == (Outcome.UNKNOWN, status, True)


def test_create_504_without_body_is_unknown() -> None:
    r = classify_create(504, _h(), b"")
    assert (r.outcome, r.http_status) == (Outcome.UNKNOWN, 504)


@pytest.mark.parametrize(
    ("exc", "outcome", "error_class"),
    [
        (httpx.ReadTimeout("timed out"), Outcome.UNKNOWN, "timeout"),
        (httpx.WriteTimeout("timed out"), Outcome.UNKNOWN, "timeout"),
        (httpx.ReadError("[Errno 104] Connection reset by peer"), Outcome.UNKNOWN, "reset"),
        (httpx.RemoteProtocolError("Server disconnected"), Outcome.UNKNOWN, "reset"),
        (httpx.WriteError("broken pipe"), Outcome.UNKNOWN, "reset"),
        (httpx.ConnectError("[Errno 111] Connection refused"), Outcome.RETRY, "connect_error"),
        (httpx.ConnectTimeout("timed out"), Outcome.RETRY, "connect_timeout"),
        (httpx.PoolTimeout("no connection"), Outcome.RETRY, "pool_timeout"),
        (httpx.ProxyError("proxy"), Outcome.UNKNOWN, "transport_error"),
    ],
)
def test_transport_rows(exc: httpx.TransportError, outcome: Outcome, error_class: str) -> None:
    # timeout / reset after sending: the payment may have been sent; connect failures: not sent
    r = classify_transport_error(exc)
    assert (r.outcome, r.http_status, r.error_class) == (outcome, None, error_class)
    assert r.error is not None and type(exc).__name__ in r.error


def test_every_create_status_of_the_protocol_is_in_the_table() -> None:
    assert set(CREATE_TABLE) == {200, 201, 400, 401, 402, 409, 422, 429, 500, 502, 503, 504}


@pytest.mark.parametrize("status", [301, 404, 405, 418, 499, 501, 507])
def test_create_statuses_not_on_the_page_count_as_maybe_sent(status: int) -> None:
    assert classify_create(status, _h(), b"<html>").outcome is Outcome.UNKNOWN


# --- lookup ---------------------------------------------------------------------------------
def test_lookup_200_of_a_stored_201_is_succeeded() -> None:
    r = classify_lookup(200, _h(), _b({**PAID, "http_status": 201}))
    assert (r.outcome, r.payment_id) == (Outcome.SUCCEEDED, "pay_1")


def test_lookup_200_of_a_stored_402_is_declined() -> None:
    body = {"error": "declined", "reason": "beneficiary_blocked", "http_status": 402}
    r = classify_lookup(200, _h(), _b(body))
    assert (r.outcome, r.reason) == (Outcome.DECLINED, "beneficiary_blocked")


def test_lookup_200_without_a_known_http_status_is_unknown() -> None:
    assert classify_lookup(200, _h(), _b(PAID)).outcome is Outcome.UNKNOWN
    assert classify_lookup(200, _h(), b"not json").outcome is Outcome.UNKNOWN


def test_lookup_404_is_not_found() -> None:
    r = classify_lookup(404, _h(), _b({"error": "not_found"}))
    assert (r.outcome, r.reason) == (Outcome.NOT_FOUND, "not_found")


def test_lookup_404_that_is_not_the_protocols_proves_nothing() -> None:
    assert classify_lookup(404, _h(), b"404: Not Found").outcome is Outcome.UNKNOWN


def test_lookup_409_is_in_flight() -> None:
    r = classify_lookup(409, _h(), _b({"error": "idempotency_key_in_use"}))
    assert r.outcome is Outcome.IN_FLIGHT


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (401, Outcome.RETRY),
        (429, Outcome.RETRY),
        (503, Outcome.RETRY),
        (500, Outcome.UNKNOWN),
        (504, Outcome.UNKNOWN),
    ],
)
def test_lookup_transient_rows(status: int, outcome: Outcome) -> None:
    assert classify_lookup(status, _h(), _b({"error": "x"})).outcome is outcome


# --- helpers --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [("2", 2.0), (" 0.5 ", 0.5), ("-3", 0.0), ("", None), (None, None), ("soon", None)],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value) == expected


def test_parse_retry_after_http_date() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    header = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(header, now=now.timestamp()) == pytest.approx(30.0)


def test_error_class_of_a_result_without_http() -> None:
    r = GatewayResult(Outcome.RETRY, None, reason="paced")
    assert r.error_class == "paced"
    assert GatewayResult(Outcome.UNKNOWN, None).error_class == "transport_error"


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("paced", "paced"),
        ("redis_error", "redis_error"),
        ("token_paused", "token"),
        ("token_wait_timeout", "token"),
        # the gateway's own failures stay in its error ratio: a token endpoint that refuses or
        # does not answer is an outage on-call must see
        ("token_connect_error", None),
        ("token_timeout", None),
        ("token_invalid_client", None),
        ("token_error", None),
        ("connect_error", None),
        (None, None),
    ],
)
def test_what_the_client_held_back_is_told_from_the_gateways_failures(
    reason: str | None, label: str | None
) -> None:
    from payment_worker.gateway.client import held_back

    assert held_back(reason) == label
