"""The gateway request as it goes on the wire (``gateway.connection.request_bytes``): the same
bytes ``http.client`` would send for it, and nothing sent for a field that would break the
framing."""

from __future__ import annotations

import http.client
from typing import Any

import pytest

from payment_worker.gateway.connection import host_field, request_bytes


class _Recording(http.client.HTTPConnection):
    """``http.client`` writing into a list instead of a socket."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.sent: list[bytes] = []

    def send(self, data: Any) -> None:
        self.sent.append(bytes(data))


def _stdlib(
    method: str, target: str, headers: dict[str, str], body: bytes | None, port: int = 80
) -> bytes:
    conn = _Recording("gw.example", port)
    conn.request(method, target, body=body, headers=headers)
    return b"".join(conn.sent)


CASES = [
    # the client's own request: its common fields, a JSON body
    (
        "POST",
        "/v1/payments",
        {
            "Host": "gw.example",
            "Accept": "application/json",
            "User-Agent": "payment-worker",
            "Authorization": "Bearer tok-1",
            "Idempotency-Key": "k-1",
            "Content-Type": "application/json",
        },
        b'{"amount":150000}',
        80,
    ),
    ("GET", "/v1/payments/k-1", {"Host": "gw.example", "Authorization": "Bearer t"}, None, 80),
    ("POST", "/v1/token", {"Authorization": "Basic eA=="}, None, 8080),  # Host added, length 0
    ("POST", "/x", {"Accept-Encoding": "gzip"}, b"", 80),  # given fields are not added again
    ("GET", "/x?a=1&b=%20", {"Content-Length": "0"}, None, 443),
]


@pytest.mark.parametrize(("method", "target", "headers", "body", "port"), CASES)
def test_the_bytes_are_http_clients(
    method: str, target: str, headers: dict[str, str], body: bytes | None, port: int
) -> None:
    host = host_field("gw.example", port, 80)
    assert request_bytes(method, target, headers, body, host) == _stdlib(
        method, target, headers, body, port
    )


def test_the_host_field_is_http_clients() -> None:
    assert host_field("gw.example", 443, 443) == "gw.example"
    assert host_field("gw.example", 8443, 443) == "gw.example:8443"
    assert host_field("::1", 8080, 80) == "[::1]:8080"
    assert host_field("bücher.example", 80, 80) == "xn--bcher-kva.example"


@pytest.mark.parametrize(
    ("method", "target", "headers"),
    [
        ("POST", "/x", {"Authorization": "Bearer a\r\nX-Evil: 1"}),  # a header injected
        ("POST", "/x", {"Authorization": "Bearer a\nb"}),
        ("POST", "/x", {"X-Key": "a\x00b"}),
        ("POST", "/x", {"Bad Name": "v"}),
        ("POST", "/x", {"X-Name:": "v"}),
        ("POST", "/x", {"X-Key": "ünïcödé ✓"}),  # beyond latin-1
        ("POST", "/x y", {}),  # a space splits the request line
        ("POST", "/x\r\nHost: evil", {}),
        ("PO ST", "/x", {}),
        ("POST", "", {}),
    ],
)
def test_a_field_that_would_break_the_framing_is_refused(
    method: str, target: str, headers: dict[str, str]
) -> None:
    with pytest.raises(ValueError):
        request_bytes(method, target, headers, b"{}", "gw.example")
