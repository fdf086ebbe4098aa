"""The gateway client: create and look up payments, classified into outcomes.

One :class:`GatewayClient` per process, shared by its threads. A request takes an idle
keep-alive connection (:class:`~payment_worker.gateway.connection.GatewayConnection`, over
the standard library's ``http.client``) from a stack shared by the threads, or opens one,
and puts it back when its answer is read: a deque's ``pop`` and ``append`` need no lock, so
hundreds of threads never queue on one, and a new task thread (Celery starts one for each
task that finds none idle) reuses a connection instead of opening its own. Transport errors
are raised as httpx's exception classes, by the phase they happened in (connect, send,
answer), which :mod:`payment_worker.gateway.outcomes` classifies. It takes the account's
shared token (:mod:`payment_worker.gateway.tokens`) and a pacing slot
(:mod:`payment_worker.gateway.pacing`) before every request, and turns every answer into a
:class:`GatewayResult` through the tables of :mod:`payment_worker.gateway.outcomes`. It
raises only for programming errors.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import redis
from redis.exceptions import RedisError

from payment_worker.domain.payment_request import PaymentRequest
from payment_worker.gateway.connection import Answer, GatewayConnection
from payment_worker.gateway.outcomes import (
    PACED,
    REDIS_ERROR,
    GatewayResult,
    HeaderLookup,
    Outcome,
    classify_create,
    classify_lookup,
    classify_transport_error,
    client_error,
    not_sent,
)
from payment_worker.gateway.pacing import Pacer, PaceResult
from payment_worker.gateway.tokens import (
    TOKEN_PAUSED,
    TOKEN_WAIT_TIMEOUT,
    SentRequest,
    TokenManager,
)
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    GATEWAY_ENDPOINTS,
    GATEWAY_NOT_SENT,
    GATEWAY_NOT_SENT_REASONS,
    GATEWAY_RATE_LIMITED,
    GATEWAY_REQUEST_SECONDS,
    GATEWAY_REQUESTS,
    GATEWAY_UNAUTHORIZED,
)
from payment_worker.settings import Settings

log = get_logger("gateway.client")

Classifier = Callable[[int, HeaderLookup, bytes], GatewayResult]
Guard = Callable[[], None]

_ACCEPT = "application/json"
_AGENT = "payment-worker"


def check_idempotency_key(key: str) -> None:
    """Raise ValueError unless ``key`` is 1 to 255 printable ASCII characters (the protocol)."""
    # isascii() and isprintable() together: exactly 0x20-0x7E (C loops, every request)
    if not 1 <= len(key) <= 255 or not (key.isascii() and key.isprintable()):
        raise ValueError(f"invalid Idempotency-Key {key!r}: need 1-255 printable ASCII chars")


class GatewayClient:
    """Thread-safe client of the aggregator protocol (``docs/gateway-protocol.md``)."""

    def __init__(self, settings: Settings, redis: redis.Redis) -> None:
        self._settings = settings
        s = settings
        self._redis = redis
        # idle keep-alive connections, the last used on top (see the module); every one
        # made, for close()
        self._idle: collections.deque[GatewayConnection] = collections.deque()
        self._connections: list[GatewayConnection] = []
        self._connections_lock = threading.Lock()
        base = httpx.URL(s.gateway_url)
        self._scheme = base.scheme
        self._host_name = base.host
        self._port = base.port or (443 if base.scheme == "https" else 80)
        self._prefix = base.raw_path.decode().rstrip("/")
        self._common = {"Host": base.netloc.decode(), "Accept": _ACCEPT, "User-Agent": _AGENT}
        self._ssl = httpx.create_ssl_context() if base.scheme == "https" else None
        # each request's two labelled series, looked up once: a labels call checks and joins
        # its values under the metric's lock, a few µs per request
        self._seconds = {e: GATEWAY_REQUEST_SECONDS.labels(e) for e in GATEWAY_ENDPOINTS}
        self._counted = {
            (e, o): GATEWAY_REQUESTS.labels(e, o.value) for e in GATEWAY_ENDPOINTS for o in Outcome
        }
        self._held_back = {
            (e, r): GATEWAY_NOT_SENT.labels(e, r)
            for e in GATEWAY_ENDPOINTS
            for r in GATEWAY_NOT_SENT_REASONS
        }
        self.tokens = TokenManager(
            redis,
            send=self._send_token,
            prefix=s.redis_key_prefix,
            refresh_fraction=s.gateway_token_refresh_fraction,
            # longer than one token request can take, so a live refresher keeps the lock
            lock_ttl=s.gateway_connect_timeout + s.gateway_read_timeout + 1.0,
            retry_after_max=s.retry_after_max_seconds,
        )
        self.pacer = Pacer(
            redis, prefix=s.redis_key_prefix, lease_seconds=s.gateway_pacing_lease_seconds
        )

    def _checkout(self) -> GatewayConnection:
        try:
            return self._idle.pop()  # atomic: no two threads get the same connection
        except IndexError:
            pass
        s = self._settings
        conn = GatewayConnection(
            self._scheme,
            self._host_name,
            self._port,
            connect_timeout=s.gateway_connect_timeout,
            read_timeout=s.gateway_read_timeout,
            ssl_context=self._ssl,
        )
        with self._connections_lock:
            self._connections.append(conn)
        return conn

    def _request(self, method: str, path: str, headers: dict[str, str], body: Any = None) -> Answer:
        """One HTTP request; the answer is read in full and the connection kept.

        Raises httpx's :class:`~httpx.TransportError` subclasses, by phase (see
        :mod:`payment_worker.gateway.connection`)."""
        return self._begin(method, path, headers, body)()

    def _begin(
        self, method: str, path: str, headers: dict[str, str], body: Any = None
    ) -> Callable[[], Answer]:
        """Send one request now; the returned call reads its answer in full (once), and only
        then does the connection go back to the pool. A send that failed raises there."""
        hdrs = {**self._common, **headers}
        content: bytes | None = None
        if body is not None:
            content = json.dumps(body, separators=(",", ":")).encode()
            hdrs["Content-Type"] = "application/json"
        conn = self._checkout()
        try:
            conn.send(method, self._prefix + path, hdrs, content)
        except BaseException as exc:
            # send() closes the socket on the errors it raises; anything else may have left
            # a request half written, which must not be followed by another here
            conn.close()
            self._idle.append(conn)
            if not isinstance(exc, Exception):
                raise
            error = exc

            def failed() -> Answer:
                raise error

            return failed

        def read() -> Answer:
            try:
                return conn.receive(method)
            except BaseException:
                # receive() closes the socket on the errors it raises; anything else may
                # have left an answer half read, which the next request must not see
                conn.close()
                raise
            finally:
                self._idle.append(conn)

        return read

    # --- the protocol -----------------------------------------------------------------
    def create_payment(
        self,
        account_id: str,
        transaction: PaymentRequest,
        idempotency_key: str,
        guard: Guard | None = None,
        *,
        held: bool = False,
    ) -> GatewayResult:
        """``POST /v1/accounts/{account_id}/payments`` with the transaction's stable key.

        ``guard`` (e.g. ``AccountLock.ensure_held``) runs right before every send, after the
        token and the pacing wait, so a lock lost while waiting stops the send (it raises).
        ``held``: the caller holds the account's lock, so past its pacing lease it keeps its
        own spacing without a Redis round trip (:mod:`payment_worker.gateway.pacing`).
        """
        if transaction.account_id != account_id:
            raise ValueError(
                f"transaction {transaction.transaction_id!r} belongs to account "
                f"{transaction.account_id!r}, not {account_id!r}"
            )
        check_idempotency_key(idempotency_key)
        path = f"/v1/accounts/{_seg(account_id)}/payments"
        return self._call(
            "create",
            account_id,
            classify_create,
            lambda token: self._request(
                "POST",
                path,
                {"Authorization": "Bearer " + token, "Idempotency-Key": idempotency_key},
                transaction.body(),
            ),
            guard,
            held,
        )

    def lookup_payment(
        self,
        account_id: str,
        idempotency_key: str,
        guard: Guard | None = None,
        *,
        held: bool = False,
    ) -> GatewayResult:
        """``GET /v1/accounts/{account_id}/payments/{idempotency_key}``; ``guard`` and
        ``held`` as above."""
        check_idempotency_key(idempotency_key)
        path = f"/v1/accounts/{_seg(account_id)}/payments/{_seg(idempotency_key)}"
        return self._call(
            "lookup",
            account_id,
            classify_lookup,
            lambda token: self._request("GET", path, {"Authorization": "Bearer " + token}),
            guard,
            held,
        )

    def account_start(self, account_id: str) -> StartRider | None:
        """What the account's first requests would read (its shared token, a block of pacing
        slots), for the lock holder to read in its lock's round trip
        (``lua/account_start.lua``); None when this process needs neither."""
        rate = self._settings.rate_for(account_id)
        token = self.tokens.start_args(account_id)
        pace = self.pacer.start_args(account_id, rate)
        if token is None and pace is None:
            return None
        return StartRider(self, account_id, token, pace)

    def prefetch_token(self, account_id: str) -> None:
        """The lock holder is about to claim its first items: a token refresh its start took
        (:meth:`account_start`) is sent now, so the token's answer arrives while the claim
        runs, and the first request reads it instead of sending one
        (:meth:`TokenManager.prefetch`). Never raises: a failed send is the first request's
        failure, as if it had sent it."""
        self.tokens.prefetch(account_id)

    def account_end(self, account_id: str) -> EndRider | None:
        """The caller is about to release the account: what this process gives back with
        it, for the lock's release to send in its own round trip (``lua/account_end.lua``),
        so the next holder, in any process, finds it given back. The unused rest of its
        pacing lease (:meth:`Pacer.returned`: the next holder starts within an interval, not
        after the lease's window) and a token refresh lock its start took and never used
        (:meth:`TokenManager.unused_start`). None when there is nothing to give back.

        Never raises for Redis: a token request already sent under that refresh lock is
        read and its token stored here, and if Redis fails then, the refresh lock's TTL
        frees it (as for any refresher that dies)."""
        given = self.pacer.returned(account_id)
        owner: str | None = None
        try:
            owner = self.tokens.unused_start(account_id)
        except RedisError as exc:
            log.warning("token_release_failed", account_id=account_id, error=str(exc))
        if given is None and owner is None:
            return None
        tat, free_ms = given if given is not None else ("", 0.0)
        return EndRider(
            (self.pacer.key(account_id), self.tokens.lock_key(account_id)),
            (tat, f"{free_ms:.3f}", owner or ""),
        )

    def close(self) -> None:
        """Close every HTTP connection (a later request opens a new one)."""
        # the list is kept: a closed connection reopens on its next use, and is closed by
        # the next close() again
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            conn.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------
    def _call(
        self,
        endpoint: str,
        account_id: str,
        classify: Classifier,
        send: Callable[[str], Answer],
        guard: Guard | None = None,
        held: bool = False,
    ) -> GatewayResult:
        rejected: str | None = None
        result: GatewayResult | None = None
        # at most two sends: the second only after a 401 and a compare-and-refresh
        for _ in range(2):
            try:
                token = self.tokens.get(account_id, rejected=rejected)
                cooling = self._cooldown_to_wait_out(token)
                if cooling is not None:
                    # a 429's cooldown holds the token request back: waited out as a slot's
                    # would be (no slot taken: it is taken below, after the token), then
                    # the token asked again
                    time.sleep(cooling)
                    token = self.tokens.get(account_id, rejected=rejected)
                if isinstance(token, GatewayResult):
                    # a token 429 closes the account as a payment's does; any other result
                    # (a pause after a failed token request included) asked nothing of it
                    if token.http_status == 429 and token.retry_after is not None:
                        self._cooldown(account_id, token.retry_after)
                    return self._done(endpoint, account_id, token)
                paced = self._pace(account_id, held)
            except RedisError as exc:
                # the shared token or the pacing bucket is out of reach: nothing was sent
                res = not_sent(REDIS_ERROR, f"{type(exc).__name__}: {exc}")
                return self._done(endpoint, account_id, res)
            if not paced.acquired:
                res = not_sent(
                    PACED,
                    f"account paced or cooling down for {paced.retry_after:.3f}s more",
                    retry_after=paced.retry_after,
                )
                return self._done(endpoint, account_id, res)
            if guard is not None:
                guard()  # the last moment before a side effect: the pacing wait may be long
            result = self._send(endpoint, classify, send, token)
            if result.http_status == 429:
                GATEWAY_RATE_LIMITED.labels(endpoint=endpoint).inc()
                self._cooldown(account_id, result.retry_after or 1.0)
            if result.http_status != 401:
                break
            GATEWAY_UNAUTHORIZED.labels(endpoint=endpoint).inc()
            rejected = token
        assert result is not None
        return self._done(endpoint, account_id, result)

    def _cooldown_to_wait_out(self, token: str | GatewayResult) -> float | None:
        """The seconds of a cooldown the token answer reports, when short enough to wait
        for here (within GATEWAY_PACING_MAX_WAIT); else None."""
        if not isinstance(token, GatewayResult) or token.reason != PACED:
            return None
        left = token.retry_after
        return left if left is not None and left <= self._settings.gateway_pacing_max_wait else None

    def _pace(self, account_id: str, held: bool) -> PaceResult:
        """Wait for a slot of the account, at most GATEWAY_PACING_MAX_WAIT."""
        return self.pacer.acquire(
            account_id,
            self._settings.rate_for(account_id),
            self._settings.gateway_pacing_max_wait,
            held=held,
        )

    def _send(
        self,
        endpoint: str,
        classify: Classifier,
        send: Callable[[str], Answer],
        token: str,
    ) -> GatewayResult:
        start = time.perf_counter()
        try:
            resp = send(token)
            return classify(resp.status_code, resp.fields, resp.content)
        except httpx.TransportError as exc:
            return classify_transport_error(exc)
        except Exception as exc:
            # a body that does not decode, a bug in the HTTP stack: the request may have
            # left, so the answer is "maybe sent", and the item is looked up, never dropped
            log.exception("gateway_client_error", endpoint=endpoint)
            return client_error(exc)
        finally:
            self._seconds[endpoint].observe(time.perf_counter() - start)

    def _cooldown(self, account_id: str, seconds: float) -> None:
        """Close the account for every process, for at most RETRY_AFTER_MAX_SECONDS."""
        seconds = min(seconds, self._settings.retry_after_max_seconds)
        try:
            self.pacer.cooldown(account_id, seconds)
        except RedisError as exc:
            # the answer is still classified; the next request may meet a 429 again
            log.warning("pacing_cooldown_not_recorded", account_id=account_id, error=str(exc))

    def _done(self, endpoint: str, account_id: str, result: GatewayResult) -> GatewayResult:
        held = None if result.sent else held_back(result.reason)
        if held is None:
            self._counted[endpoint, result.outcome].inc()
        else:
            self._held_back[endpoint, held].inc()
        if result.outcome in (Outcome.UNKNOWN, Outcome.PERMANENT) or (
            result.outcome is Outcome.RETRY and result.http_status != 409
        ):
            log.warning(
                "gateway_answer",
                endpoint=endpoint,
                account_id=account_id,
                outcome=result.outcome.value,
                error_class=result.error_class,
                error=result.error,
            )
        return result

    def _send_token(self, account_id: str) -> SentRequest:
        """``POST /oauth/token`` sent now; its answer read by the result's ``read``, on the
        same connection, which goes back to the pool then (and only then)."""
        body: dict[str, Any] = {
            "grant_type": "client_credentials",
            "client_id": account_id,
            "client_secret": _secret(self._settings),
        }
        sent_at = time.monotonic()
        answer = self._begin("POST", "/oauth/token", {}, body)
        return SentRequest(sent_at, answer)


class StartRider:
    """A lock attempt's rider (:class:`payment_worker.locks.arrival.Rider`): the account's
    token read and pacing lease, in the lock's round trip; their answers go to the client's
    :class:`TokenManager` and :class:`Pacer` as if the first request had read them."""

    __slots__ = ("_account", "_client", "_owner", "_rate", "_sent", "args", "keys")

    def __init__(
        self,
        client: GatewayClient,
        account_id: str,
        token: tuple[str, int] | None,
        pace: tuple[float, int, float] | None,
    ) -> None:
        self._client = client
        self._account = account_id
        self._owner, ttl_ms = token if token is not None else ("", 0)
        self._rate = pace[0] if pace is not None else 0.0
        # the lease's window is counted from before the script left, as for any lease
        self._sent = client.pacer.now()
        self.keys = (
            client.tokens.token_key(account_id),
            client.tokens.lock_key(account_id),
            client.pacer.key(account_id),
        )
        self.args: tuple[str | int | float, ...] = (
            self._owner,
            ttl_ms,
            *(pace if pace is not None else ("", 0, 0)),
        )

    def taken(self, token: list[Any], pace: list[Any]) -> None:
        """The lock was taken and the script read what was asked (never raises: a failure
        here leaves the requests to read for themselves)."""
        try:
            if token:
                self._client.tokens.started(self._account, self._owner, token)
            if pace:
                self._client.pacer.started(self._account, self._rate, pace, self._sent)
        except Exception:
            log.exception("account_start_not_kept", account_id=self._account)


@dataclass(frozen=True, slots=True)
class EndRider:
    """What rides on a lock's release (:class:`payment_worker.locks.arrival.EndRider`,
    ``lua/account_end.lua``'s KEYS[5..6] and ARGV[3..5]): the account's pacing state and
    token refresh lock; the lease's ``tat`` or '', the ms from now to the account's next free
    slot (:meth:`Pacer.returned`), the refresh lock's owner or ''.
    """

    keys: tuple[str, str]
    args: tuple[bytes | str | float, ...]


def _seg(value: str) -> str:
    """One URL path segment, percent-encoded."""
    return quote(value, safe="")


def _secret(settings: Settings) -> str:
    """GATEWAY_CLIENT_SECRET (the settings fill in the simulator's for a loopback gateway)."""
    secret = settings.gateway_client_secret
    return secret.get_secret_value() if secret is not None else ""


def held_back(reason: str | None) -> str | None:
    """What a result the client did not send waited for (a label of
    ``payment_worker_gateway_not_sent_total``), or None for one the gateway caused and which
    is counted with its answers: a refused connection, and a token request the token
    endpoint refused or did not answer (a gateway outage must show in its error ratio)."""
    if reason in (PACED, REDIS_ERROR):
        return reason
    if reason in (TOKEN_PAUSED, TOKEN_WAIT_TIMEOUT):
        return "token"  # held back by this client: paused after failures, or waited too long
    return None
