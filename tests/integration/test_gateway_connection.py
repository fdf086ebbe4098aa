"""GatewayConnection against a real TCP peer that answers as scripted: framing, keep-alive
reuse, stale connections, and every failure raised as the phase it happened in.

The simulator (aiohttp) answers well; these peers answer the ways other gateways and the
proxies in front of them may: chunked, close-delimited, ``Connection: close``, cut short,
malformed, silent, or closing a kept connection while it idles.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from pydantic import SecretStr

from payment_worker.gateway import GatewayClient
from payment_worker.gateway import connection as gateway_connection
from payment_worker.gateway.connection import GatewayConnection
from payment_worker.gateway.outcomes import Outcome, classify_transport_error
from payment_worker.settings import Settings
from tests.conftest import PwEnv

Handler = Callable[[int, socket.socket], None]


class Peer:
    """A listening socket; each accepted connection runs ``handler(index, sock)`` in a thread."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self._handler = handler
        self._tls = tls
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self.requests: list[bytes] = []  # every request line read, in order
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            index = self.accepted
            self.accepted += 1
            t = threading.Thread(target=self._serve, args=(index, sock), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, index: int, sock: socket.socket) -> None:
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_side=True)
            except (ssl.SSLError, OSError):
                sock.close()  # the client refused the certificate: nothing more comes
                return
        with sock:
            self._handler(index, sock)

    def read_request(self, sock: socket.socket) -> bool:
        """Read one request (head and Content-Length body); False when the client closed."""
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.requests.append(lines[0])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += sock.recv(65536)
        return True

    def close(self) -> None:
        self._listener.close()
        for t in self._threads:
            t.join(timeout=5)


@pytest.fixture
def peer() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(handler: Handler, tls: ssl.SSLContext | None = None) -> Peer:
        p = Peer(handler, tls)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def connect(p: Peer, read_timeout: float = 2.0) -> GatewayConnection:
    return GatewayConnection(
        "http", "127.0.0.1", p.port, connect_timeout=2.0, read_timeout=read_timeout
    )


def post(conn: GatewayConnection) -> gateway_connection.Answer:
    return conn.request("POST", "/v1/x", {"Host": "gw"}, b'{"a":1}')


OK = b'HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n{"id":1}'


def serve(
    make: Callable[..., Peer],
    handler: Callable[[Peer, int, socket.socket], None],
    tls: ssl.SSLContext | None = None,
) -> Peer:
    """A peer whose handler also gets the peer (to read requests and count them)."""
    box: list[Peer] = []
    p = make(lambda i, s: handler(box[0], i, s), tls)
    box.append(p)
    return p


def answering(answers: list[bytes]) -> Callable[[Peer, int, socket.socket], None]:
    """A handler that answers each request on its connection with the next of ``answers``."""

    def handler(p: Peer, _: int, sock: socket.socket) -> None:
        for answer in answers:
            if not p.read_request(sock):
                return
            sock.sendall(answer)

    return handler


def keep_answering(p: Peer, _: int, sock: socket.socket) -> None:
    """Answer OK to every request on the connection, keeping it open."""
    while p.read_request(sock):
        sock.sendall(OK)


def test_a_kept_connection_carries_every_request(peer: Callable[..., Peer]) -> None:
    p = serve(peer, keep_answering)
    conn = connect(p)
    answers = [post(conn) for _ in range(5)]
    assert [(a.status_code, a.content) for a in answers] == [(201, b'{"id":1}')] * 5
    assert ("Content-Type", "application/json") in answers[0].raw_headers
    assert answers[0].headers["content-type"] == "application/json"
    assert p.accepted == 1 and len(p.requests) == 5
    conn.close()


def test_chunked_and_close_delimited_bodies_are_read_whole(
    peer: Callable[..., Peer],
) -> None:
    def handler(p: Peer, index: int, sock: socket.socket) -> None:
        if not p.read_request(sock):
            return
        if index == 0:
            sock.sendall(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b'4\r\n{"id\r\n5\r\n":12}\r\n0\r\n\r\n'
            )
            p.read_request(sock)  # kept: the next request comes here
            sock.sendall(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"id":13}')
        # a close-delimited body ends when the peer closes (leaving this handler)

    p = serve(peer, handler)
    conn = connect(p)
    assert post(conn).content == b'{"id":12}'
    assert post(conn).content == b'{"id":13}'
    assert p.accepted == 1


def test_connection_close_opens_a_new_connection_for_the_next_request(
    peer: Callable[..., Peer],
) -> None:
    def handler(p: Peer, _: int, sock: socket.socket) -> None:
        if p.read_request(sock):
            sock.sendall(
                b"HTTP/1.1 201 Created\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
            )

    p = serve(peer, handler)
    conn = connect(p)
    assert [post(conn).status_code for _ in range(3)] == [201, 201, 201]
    assert p.accepted == 3


def test_a_kept_connection_the_peer_closed_is_not_written_into(
    peer: Callable[..., Peer],
) -> None:
    """The peer answers and closes while the connection idles (an idle timeout): the next
    request goes on a new connection, so a request never lands in a dead one and looks
    "maybe sent"."""

    def handler(p: Peer, _: int, sock: socket.socket) -> None:
        if p.read_request(sock):
            sock.sendall(OK)  # keep-alive announced, then closed anyway

    p = serve(peer, handler)
    conn = connect(p)
    assert post(conn).status_code == 201
    time.sleep(0.2)  # the peer's close has arrived
    assert post(conn).status_code == 201
    assert p.accepted == 2 and len(p.requests) == 2


def test_a_connection_idle_past_the_expiry_is_replaced(
    peer: Callable[..., Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_connection, "KEEPALIVE_EXPIRY", 0.2)

    p = serve(peer, keep_answering)
    conn = connect(p)
    post(conn)
    post(conn)
    assert p.accepted == 1
    time.sleep(0.3)
    post(conn)
    assert p.accepted == 2


@pytest.mark.parametrize(
    ("answer", "raised", "reason"),
    [
        (b"", httpx.RemoteProtocolError, "reset"),  # closed before a status line
        (b"HTTP/1.1 2x1 Created\r\n\r\n", httpx.RemoteProtocolError, "reset"),
        (b"garbage\r\n\r\n", httpx.RemoteProtocolError, "reset"),
        (
            b'HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{"id',
            httpx.RemoteProtocolError,
            "reset",
        ),
        (
            b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"id',
            httpx.RemoteProtocolError,
            "reset",
        ),
        # the header block is read by gateway/connection.py (not email.parser): every way it
        # can be wrong is a malformed answer, never a misread one
        (b"HTTP/1.1 201 Created\r\nContent-Length: 8\r\n", httpx.RemoteProtocolError, "reset"),
        (b"HTTP/1.1 201 Created\r\nno colon here\r\n\r\n", httpx.RemoteProtocolError, "reset"),
        (
            b"HTTP/1.1 201 Created\r\nContent-Length : 8\r\n\r\n",
            httpx.RemoteProtocolError,
            "reset",
        ),
        (
            b"HTTP/1.1 201 Created\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n",
            httpx.RemoteProtocolError,
            "reset",
        ),
        (
            b"HTTP/1.1 201 Created\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n",
            httpx.RemoteProtocolError,
            "reset",
        ),
        # folded lines count too: endless folds were an unbounded header block
        (
            b"HTTP/1.1 201 Created\r\nX-A: 1\r\n" + b" more\r\n" * 101 + b"\r\n",
            httpx.RemoteProtocolError,
            "reset",
        ),
        # never asked for, and no HTTP after it
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", httpx.RemoteProtocolError, "reset"),
    ],
    ids=[
        "closed",
        "bad-status",
        "not-http",
        "body-cut",
        "chunk-cut",
        "headers-cut",
        "no-colon",
        "space-before-colon",
        "too-many-headers",
        "header-too-long",
        "too-many-folded-lines",
        "switching-protocols",
    ],
)
def test_an_answer_cut_short_or_malformed_is_maybe_sent(
    peer: Callable[..., Peer], answer: bytes, raised: type[Exception], reason: str
) -> None:
    def handler(p: Peer, _: int, sock: socket.socket) -> None:
        if p.read_request(sock):
            sock.sendall(answer)

    p = serve(peer, handler)
    conn = connect(p)
    with pytest.raises(raised) as info:
        post(conn)
    assert len(p.requests) == 1  # it was sent, so the outcome is unknown, never "not sent"
    result = classify_transport_error(info.value)  # type: ignore[arg-type]
    assert (result.outcome, result.reason, result.sent) == (Outcome.UNKNOWN, reason, True)
    # the connection is dropped: the next request opens a new one
    with pytest.raises(raised):
        post(conn)
    assert p.accepted == 2


def test_the_header_block_is_read_as_http_client_would(peer: Callable[..., Peer]) -> None:
    # a 100 answer is skipped, names are matched in any case, repeated fields keep their
    # order (the first is the one looked up), a folded line continues its field, and
    # Content-Length frames the body so the connection is kept
    answers = [
        b"HTTP/1.1 100 Continue\r\nX-Skip: yes\r\n\r\n"
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
        b"Idempotent-Replayed:  true \r\nX-Multi: a\r\nx-multi: b\r\n"
        b"X-Folded: one\r\n two\r\nRetry-After: 3\r\nContent-Length: 8\r\n\r\n"
        b'{"id":1}',
        OK,
    ]

    p = serve(peer, answering(answers))
    conn = connect(p)
    first = post(conn)
    assert (first.status_code, first.content) == (201, b'{"id":1}')
    assert first.raw_headers == [
        ("content-type", "application/json"),
        ("Idempotent-Replayed", "true"),
        ("X-Multi", "a"),
        ("x-multi", "b"),
        ("X-Folded", "one two"),
        ("Retry-After", "3"),
        ("Content-Length", "8"),
    ]
    headers = first.headers
    assert headers["idempotent-replayed"] == "true" and headers["retry-after"] == "3"
    assert headers.get_list("X-MULTI") == ["a", "b"]
    assert post(conn).status_code == 201
    assert p.accepted == 1  # the framing was right: one kept connection for both


def test_every_interim_answer_is_skipped_and_the_connection_stays_in_step(
    peer: Callable[..., Peer],
) -> None:
    """102 and 103 are interim answers like 100. Taken as the final answer (http.client
    skips 100 alone), a 102 left the real answer on the kept connection, and the next
    request read it as its own: one payment's 201 recorded for another (a review found it)."""
    first = (
        b"HTTP/1.1 102 Processing\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b'HTTP/1.1 201 Created\r\nContent-Length: 8\r\n\r\n{"id":1}'
    )
    second = b'HTTP/1.1 402 Payment Required\r\nContent-Length: 8\r\n\r\n{"id":2}'
    answers = [first, second]

    p = serve(peer, answering(answers))
    conn = connect(p)
    one = post(conn)
    assert (one.status_code, one.content) == (201, b'{"id":1}')
    two = post(conn)
    assert (two.status_code, two.content) == (402, b'{"id":2}')
    assert p.accepted == 1  # the same kept connection, each answer read by its own request


def test_no_answer_within_the_read_timeout_is_a_read_timeout(
    peer: Callable[..., Peer],
) -> None:
    stop = threading.Event()

    def handler(p: Peer, _: int, sock: socket.socket) -> None:
        if p.read_request(sock):
            stop.wait(10)

    p = serve(peer, handler)
    conn = connect(p, read_timeout=0.3)
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout) as info:
        post(conn)
    assert time.monotonic() - start < 2
    stop.set()
    result = classify_transport_error(info.value)
    assert (result.outcome, result.reason, result.sent) == (Outcome.UNKNOWN, "timeout", True)


def test_a_peer_that_reads_nothing_is_a_write_timeout_within_the_bound(
    peer: Callable[..., Peer],
) -> None:
    stop = threading.Event()

    def handler(_: Peer, __: int, sock: socket.socket) -> None:
        stop.wait(10)  # never reads: the client's send fills both socket buffers

    p = serve(peer, handler)
    conn = connect(p, read_timeout=0.3)
    start = time.monotonic()
    with pytest.raises(httpx.WriteTimeout) as info:
        conn.request("POST", "/v1/x", {"Host": "gw"}, b"x" * 64_000_000)
    assert time.monotonic() - start < 5
    stop.set()
    result = classify_transport_error(info.value)
    assert (result.outcome, result.reason, result.sent) == (Outcome.UNKNOWN, "timeout", True)


def test_each_request_is_one_write(peer: Callable[..., Peer]) -> None:
    """The request line, the headers and the body leave in one write (http.client alone
    sends the body in a second one): the peer's first read of each request holds all of it."""
    firsts: list[bytes] = []

    def handler(_: Peer, __: int, sock: socket.socket) -> None:
        while True:
            chunk = sock.recv(65536)  # woken by the first segment that arrives
            if not chunk:
                return
            firsts.append(chunk)
            sock.sendall(OK)

    p = serve(peer, handler)
    conn = connect(p)
    for _ in range(20):
        assert post(conn).status_code == 201
    assert len(firsts) == 20
    assert all(
        f.startswith(b"POST /v1/x HTTP/1.1\r\n") and f.endswith(b'\r\n\r\n{"a":1}') for f in firsts
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel timeouts: Linux only")
def test_a_plain_connection_is_bounded_by_the_kernel(peer: Callable[..., Peer]) -> None:
    """On Linux a plain TCP connection is a blocking socket whose sends and receives the
    kernel bounds (one system call each, not a poll and the call); TLS keeps Python's."""
    p = serve(peer, keep_answering)
    conn = connect(p, read_timeout=1.5)
    assert post(conn).status_code == 201
    sock = conn._conn.sock
    assert sock is not None and sock.gettimeout() is None
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, 16))
        assert (sec, usec) == (1, 500_000)
    assert post(conn).status_code == 201 and p.accepted == 1  # still one kept connection


def test_a_refused_connection_is_not_sent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    conn = GatewayConnection("http", "127.0.0.1", port, connect_timeout=1.0, read_timeout=1.0)
    with pytest.raises(httpx.ConnectError) as info:
        post(conn)
    result = classify_transport_error(info.value)
    assert (result.outcome, result.reason, result.sent) == (Outcome.RETRY, "connect_error", False)


def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent(
    peer: Callable[..., Peer],
) -> None:
    p = serve(peer, keep_answering)
    conn = connect(p)
    with pytest.raises(httpx.LocalProtocolError):
        conn.request("POST", "/v1/x", {"Authorization": "Bearer a\r\nX-Evil: 1"}, b"{}")
    assert post(conn).status_code == 201  # the connection is usable again
    assert p.requests == [b"POST /v1/x HTTP/1.1"]


# --- TLS: real gateways are https ------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl; .ci/run installs it when missing)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed for the TLS tests (.ci/run installs it)"
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def server_tls(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(certificate[0]), str(certificate[1]))
    return ctx


def test_https_carries_requests_on_one_kept_connection(
    peer: Callable[..., Peer], certificate: tuple[Path, Path]
) -> None:
    p = serve(peer, keep_answering, server_tls(certificate))
    trusting = ssl.create_default_context(cafile=str(certificate[0]))
    conn = GatewayConnection(
        "https", "127.0.0.1", p.port, connect_timeout=2.0, read_timeout=2.0, ssl_context=trusting
    )
    assert [post(conn).content for _ in range(3)] == [b'{"id":1}'] * 3
    assert p.accepted == 1 and len(p.requests) == 3
    conn.close()


def test_a_certificate_not_trusted_is_a_connect_error_and_nothing_is_sent(
    peer: Callable[..., Peer], certificate: tuple[Path, Path]
) -> None:
    p = serve(peer, keep_answering, server_tls(certificate))
    conn = GatewayConnection(
        "https",
        "127.0.0.1",
        p.port,
        connect_timeout=2.0,
        read_timeout=2.0,
        ssl_context=ssl.create_default_context(),  # the system's roots: not our certificate
    )
    with pytest.raises(httpx.ConnectError) as info:
        post(conn)
    result = classify_transport_error(info.value)
    assert (result.outcome, result.reason, result.sent) == (Outcome.RETRY, "connect_error", False)
    assert p.requests == []


def test_the_client_speaks_https_to_an_https_gateway_url(
    pw_env: PwEnv,
    peer: Callable[..., Peer],
    certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GatewayClient end to end over TLS: its context (httpx's, which reads SSL_CERT_FILE),
    the port and Host header of the URL, a token, then a lookup."""

    def gateway(p: Peer, _: int, sock: socket.socket) -> None:
        while p.read_request(sock):
            if p.requests[-1].startswith(b"POST /oauth/token "):
                body = json.dumps({"access_token": "tok-1", "expires_in": 600}).encode()
                status = b"200 OK"
            else:
                body, status = b'{"error":"not_found"}', b"404 Not Found"
            sock.sendall(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )

    p = serve(peer, gateway, server_tls(certificate))
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    settings = Settings().model_copy(
        update={
            "gateway_url": f"https://127.0.0.1:{p.port}",
            "gateway_client_secret": SecretStr("s"),
        }
    )
    client = GatewayClient(settings, redis.Redis.from_url(settings.redis_url))
    try:
        looked = client.lookup_payment("acct-tls", "pw1-key")
    finally:
        client.close()
    assert looked.outcome is Outcome.NOT_FOUND
    assert [r.split(b" ")[:2] for r in p.requests] == [
        [b"POST", b"/oauth/token"],
        [b"GET", b"/v1/accounts/acct-tls/payments/pw1-key"],
    ]
    assert p.accepted == 1  # the token and the lookup on one kept TLS connection
