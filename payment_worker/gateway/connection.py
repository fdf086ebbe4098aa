"""One keep-alive HTTP/1.1 connection to the gateway per thread, over the standard library's
``http.client``.

A worker thread drives one account at a time and so has at most one request in flight: it
needs one connection, not a pool. ``http.client`` connects (TCP, TLS) and reads the answer
(status line, ``Content-Length``, chunked and close-delimited bodies, 1xx answers) at about
180 µs of CPU per request where ``httpcore`` over ``h11`` took about 290 (measured against
the simulator, docs/benchmarks.md), and it is part of the standard library. Two parts are
done here instead, both on every request's path: the answer's header block
(:func:`read_header_block`), which ``http.client`` would hand to ``email.parser``, and the
request itself (:func:`request_bytes`): one ``bytes`` built from the request line and the
fields, where ``http.client`` checks and encodes each field in a call of its own (its
``putheader`` alone was about 8 % of a drain's profiled CPU, docs/benchmarks.md).

What this module adds is what decides whether a payment may be sent again: every failure is
raised as the httpx exception class of the phase it happened in, which
:mod:`payment_worker.gateway.outcomes` classifies.

* **connect** (nothing sent): :class:`httpx.ConnectTimeout`, :class:`httpx.ConnectError`.
  The connection is opened here, never by ``http.client``'s automatic reconnect inside the
  send, so a connect failure can never be mistaken for a failed send, or the reverse;
* **send** (some bytes may have left): :class:`httpx.WriteTimeout`,
  :class:`httpx.WriteError`;
* **answer** (the request left): :class:`httpx.ReadTimeout`, :class:`httpx.ReadError`,
  :class:`httpx.RemoteProtocolError`.

A kept connection is reused only when it is fresh: idle for less than
``KEEPALIVE_EXPIRY`` seconds, and not readable (a server that closed it, or sent something
unasked, makes it readable). Otherwise it is closed and a new one opened, so a request is not
written into a connection the server already dropped: that would make a request that never
arrived look "maybe sent". After any failure the connection is closed: its state is unknown.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import ssl
import struct
import sys
import time
from typing import Any

import httpx

KEEPALIVE_EXPIRY = 5.0  # seconds idle after which a kept connection is not reused (httpx's)
# http.client's own bounds on an answer's header block (_MAXLINE, _MAXHEADERS)
MAX_HEADER_LINE = 65536
MAX_HEADERS = 100


# what may go into a request (RFC 9110): a method and a field name are tokens; a target has
# no space or control character; a field value no CR, LF or NUL (a header injection)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
# http.client sends a zero length for these methods when they have no body
_BODY_METHODS = frozenset({"PATCH", "POST", "PUT"})


def request_bytes(
    method: str, target: str, headers: dict[str, str], body: bytes | None, host: str
) -> bytes:
    """One HTTP/1.1 request as it goes on the wire: what ``http.client``'s ``request``
    would send, with the same fields added when absent (``Host``, ``Accept-Encoding:
    identity``, ``Content-Length``), in one buffer. Raises :class:`ValueError` for a method,
    target, field name or value that could break the request's framing (nothing sent)."""
    if not _TOKEN.fullmatch(method) or _BAD_TARGET.search(target) or not target:
        raise ValueError(f"not a request line: {method[:20]!r} {target[:80]!r}")
    lines = [f"{method} {target} HTTP/1.1"]
    names = {name.lower() for name in headers}
    if "host" not in names:
        lines.append(f"Host: {host}")
    if "accept-encoding" not in names:
        lines.append("Accept-Encoding: identity")
    if "content-length" not in names and (body is not None or method in _BODY_METHODS):
        lines.append(f"Content-Length: {len(body) if body is not None else 0}")
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise ValueError(f"invalid header {name[:40]!r}: a value may not break a line")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    # latin-1, as http.client encodes fields; a character beyond it is a ValueError too
    head = "\r\n".join(lines).encode("latin-1")
    return head + body if body else head


def host_field(host: str, port: int, default_port: int) -> str:
    """The ``Host`` field ``http.client`` sends for ``host:port`` (IDNA, IPv6 brackets, the
    port left out when it is the scheme's)."""
    try:
        name = host.encode("ascii").decode()
    except UnicodeEncodeError:
        name = host.encode("idna").decode()
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return name if port == default_port else f"{name}:{port}"


class Headers:
    """An answer's header fields in order, looked up without regard to case: what
    ``http.client`` reads of its ``HTTPMessage`` here (``get`` in ``begin`` and
    ``_check_close``, ``items`` in ``getheaders``). Not ``httpx.Headers``: its ``get`` and
    ``items`` join repeated fields, where ``http.client`` takes the first (a length)."""

    __slots__ = ("_fields", "_first")

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        self._fields = fields
        # each answer is looked up four times or more (framing, keep-alive, the tables):
        # one pass builds the first value of each name
        first: dict[str, str] = {}
        for key, value in fields:
            first.setdefault(key.lower(), value)
        self._first = first

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first field called ``name`` (any case), or ``default``."""
        return self._first.get(name.lower(), default)

    def items(self) -> list[tuple[str, str]]:
        """Every field as (name, value), in the order received."""
        return list(self._fields)


def read_header_block(fp: Any) -> Headers:
    """Read an answer's header block up to its empty line, with ``http.client``'s bounds.

    ``http.client`` hands the block to ``email.parser``, about 60 to 80 µs of CPU per answer,
    the largest single share of a drain's CPU (issue 13, docs/benchmarks.md); a header block
    needs none of what that parser does for mail. A folded line (obs-fold) continues the field
    before it. A line that is no field, or a connection that ends inside the block, is a
    malformed answer: raised, so the request stays "maybe sent", never misread."""
    fields: list[tuple[str, str]] = []
    lines = 0
    while True:
        line = fp.readline(MAX_HEADER_LINE + 1)
        if len(line) > MAX_HEADER_LINE:
            raise http.client.LineTooLong("header line")
        if line in (b"\r\n", b"\n"):
            return Headers(fields)
        if not line:
            raise http.client.IncompleteRead(b"", None)  # ended inside the header block
        lines += 1
        if lines > MAX_HEADERS:  # every line counts, folded ones too (as http.client's)
            raise http.client.HTTPException(f"got more than {MAX_HEADERS} headers")
        text = line.decode("iso-8859-1").rstrip("\r\n")
        if text[:1] in (" ", "\t") and fields:
            name, value = fields[-1]
            fields[-1] = (name, f"{value} {text.strip()}")
            continue
        name, colon, value = text.partition(":")
        if not colon or not name or name != name.strip():
            raise http.client.HTTPException(f"malformed header line {text[:80]!r}")
        fields.append((name, value.strip(" \t")))


class _Response(http.client.HTTPResponse):
    """``http.client``'s answer with its header block read by :func:`read_header_block`.

    ``begin`` is the standard library's (CPython 3.11 to 3.13): the version, chunked or not,
    the length, whether the connection closes. It differs in the parse of the header block,
    and in skipping every interim answer (1xx), not 100 alone, and refusing a 101. The body
    is read by ``http.client`` as before."""

    def begin(self) -> None:
        if self.headers is not None:
            return  # already begun
        while True:
            version, status, reason = self._read_status()
            if status == http.client.SWITCHING_PROTOCOLS:  # never asked for: not HTTP after it
                raise http.client.HTTPException("101 Switching Protocols, never asked for")
            if not 100 <= status < 200:
                break
            # an interim answer (100, 102 Processing, 103 Early Hints...): its headers skipped,
            # the final answer follows. Taken as the answer, it left the real one on the
            # connection for the next request to read as its own (a review found it)
            read_header_block(self.fp)
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        self.headers = self.msg = read_header_block(self.fp)
        encoding = self.headers.get("transfer-encoding")
        self.chunked = bool(encoding and encoding.lower() == "chunked")
        if self.chunked:
            self.chunk_left = None
        self.will_close = self._check_close()
        self.length = None
        length = self.headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                self.length = None
            else:
                if self.length < 0:
                    self.length = None
        if (
            status in (http.client.NO_CONTENT, http.client.NOT_MODIFIED)
            or 100 <= status < 200
            or self._method == "HEAD"
        ):
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True


# SO_RCVTIMEO / SO_SNDTIMEO take a struct timeval: (long, long) on Linux
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")


class _KernelTimedSocket(socket.socket):
    """A blocking TCP socket whose send and receive are bounded by the kernel
    (``SO_SNDTIMEO`` / ``SO_RCVTIMEO``), not by Python's socket timeout.

    Why: with a Python timeout every send and every receive is a ``poll`` and then the call,
    and each of the two gives up the GIL; a thread that gives it up while hundreds of others
    want it waits its turn to take it back. Here each is one system call (a request: 7 → 3,
    docs/gateway.md). The bound is the same: each call waits at most the read timeout. A
    call the kernel bounded fails with ``EAGAIN``, raised here as the ``TimeoutError``
    Python's own timeout raises, so every caller sees what it saw before."""

    __slots__ = ()

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        try:
            return super().recv_into(buffer, nbytes, flags)
        except BlockingIOError as exc:  # SO_RCVTIMEO passed with nothing received
            raise TimeoutError("timed out") from exc

    def sendall(self, data: Any, flags: int = 0) -> None:
        try:
            super().sendall(data, flags)
        except BlockingIOError as exc:  # SO_SNDTIMEO passed (some bytes may have left)
            raise TimeoutError("timed out") from exc


def _bounded(sock: socket.socket, seconds: float) -> socket.socket:
    """``sock`` with each send and receive bounded by ``seconds``: by the kernel for a plain
    TCP socket on Linux (:class:`_KernelTimedSocket`), else by Python's timeout (TLS: the ssl
    module retries a blocking socket's interrupted read, so only its own timeout bounds it)."""
    if not _KERNEL_TIMEOUTS or type(sock) is not socket.socket:  # an SSLSocket among others
        sock.settimeout(seconds)
        return sock
    whole = int(seconds)
    # (0, 0) would mean no bound at all: at least a microsecond
    micros = max(int((seconds - whole) * 1_000_000), 0 if whole else 1)
    timeval = struct.pack("ll", whole, micros)
    sock.settimeout(None)  # blocking: one system call per send or receive
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    return _KernelTimedSocket(fileno=sock.detach())


class Answer:
    """An HTTP answer read in full: status, headers, body (what the outcome tables read)."""

    __slots__ = ("content", "fields", "status_code")

    def __init__(self, status_code: int, fields: Headers, content: bytes):
        self.status_code = status_code
        self.fields = fields  # the outcome tables' lookups: the first field of a name
        self.content = content

    @property
    def raw_headers(self) -> list[tuple[str, str]]:
        """Every header field as (name, value), in the order received."""
        return self.fields.items()

    @property
    def headers(self) -> httpx.Headers:
        """The headers as ``httpx.Headers`` (built on demand: the tables read ``fields``)."""
        return httpx.Headers(self.raw_headers)

    @property
    def text(self) -> str:
        """The body as text (UTF-8, what the gateway protocol sends)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON (``ValueError`` when it is not)."""
        return json.loads(self.content)


class GatewayConnection:
    """A keep-alive connection to one ``host:port``, used by one thread at a time."""

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int,
        *,
        connect_timeout: float,
        read_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._read_timeout = read_timeout  # the connect's bound is the connection's timeout
        # http.client only connects here (TCP, TLS) and closes: requests are written and
        # answers read below, so its own request state machine is never used
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(
                host, port, timeout=connect_timeout, context=ssl_context
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=connect_timeout)
        self._conn = conn
        self._host = host_field(host, port, conn.default_port)
        self._last_used = 0.0

    def request(
        self, method: str, target: str, headers: dict[str, str], body: bytes | None
    ) -> Answer:
        """Send one request and read its answer in full; raises httpx's transport errors."""
        self.send(method, target, headers, body)
        return self.receive(method)

    def send(self, method: str, target: str, headers: dict[str, str], body: bytes | None) -> None:
        """Send one request, connecting first when needed; raises httpx's transport errors.
        Its answer is read by :meth:`receive`, before anything else is sent here."""
        try:
            data = request_bytes(method, target, headers, body, self._host)
        except ValueError as exc:  # a field that would break the framing: nothing is sent,
            # but it is classified as maybe sent like any unexpected error
            raise httpx.LocalProtocolError(f"send: {exc}") from exc
        conn = self._conn
        if conn.sock is not None and not self._fresh(conn.sock):
            conn.close()
        if conn.sock is None:
            try:
                conn.connect()
            except TimeoutError as exc:
                conn.close()
                raise httpx.ConnectTimeout(f"connect: {exc or 'timed out'}") from exc
            except OSError as exc:
                conn.close()
                raise httpx.ConnectError(f"connect: {exc}") from exc
            if conn.sock is not None:  # the send's and the answer's bound
                conn.sock = _bounded(conn.sock, self._read_timeout)
        sock = conn.sock
        try:
            # the request line, the fields and the body in one write: one segment, one
            # hand-over of the GIL
            sock.sendall(data)
        except TimeoutError as exc:
            conn.close()
            raise httpx.WriteTimeout(f"send: {exc or 'timed out'}") from exc
        except OSError as exc:
            conn.close()
            raise httpx.WriteError(f"send: {type(exc).__name__}: {exc}") from exc

    def receive(self, method: str) -> Answer:
        """Read the answer of the request :meth:`send` sent, in full; raises httpx's
        transport errors."""
        conn = self._conn
        sock = conn.sock
        if sock is None:  # closed since the send (a failed send raised already)
            raise httpx.ReadError("answer: the connection is closed")
        try:
            # what http.client's getresponse does, without its request state machine
            response = _Response(sock, method=method)
            response.begin()
            content = response.read()
        except TimeoutError as exc:
            conn.close()
            raise httpx.ReadTimeout(f"answer: {exc or 'timed out'}") from exc
        except http.client.RemoteDisconnected as exc:  # closed before a status line
            conn.close()
            raise httpx.RemoteProtocolError(f"answer: {exc}") from exc
        except OSError as exc:
            conn.close()
            raise httpx.ReadError(f"answer: {type(exc).__name__}: {exc}") from exc
        except http.client.HTTPException as exc:  # a malformed or cut-short answer
            conn.close()
            raise httpx.RemoteProtocolError(f"answer: {type(exc).__name__}: {exc}") from exc
        self._last_used = time.monotonic()
        if response.will_close:
            conn.close()  # "Connection: close", or a close-delimited body: the next opens anew
        assert isinstance(response.headers, Headers)
        return Answer(response.status, response.headers, content)

    def close(self) -> None:
        """Close the connection (a later request opens a new one)."""
        self._conn.close()

    def _fresh(self, sock: socket.socket) -> bool:
        if time.monotonic() - self._last_used >= KEEPALIVE_EXPIRY:
            return False
        # bytes TLS has decrypted already sit in the ssl object, where poll cannot see them
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return False
        # poll, not select: a worker's descriptors pass FD_SETSIZE (1,024) at high concurrency
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
