"""The token endpoint's answer (``POST /oauth/token``) read: a token and its lifetime, or
the not-sent result of a request that gave none."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from payment_worker.gateway.outcomes import GatewayResult, Outcome, parse_retry_after
from payment_worker.ops.logging import get_logger
from payment_worker.ops.redaction import redact

log = get_logger("gateway.tokens")


class TokenAnswer(Protocol):
    """What the token manager reads of an answer to ``POST /oauth/token``: the client's
    :class:`~payment_worker.gateway.connection.Answer` (no ``httpx.Response`` built for it)
    or an ``httpx.Response`` (tests, other fetchers)."""

    @property
    def status_code(self) -> int:
        """The HTTP status."""

    @property
    def text(self) -> str:
        """The body as text."""

    @property
    def headers(self) -> Mapping[str, str]:
        """The header fields, by name (case-insensitive)."""

    def json(self) -> Any:
        """The body parsed as JSON (ValueError when it is not)."""


def parse_token(resp: TokenAnswer) -> tuple[str | None, float | None]:
    """The access token and its lifetime in seconds of a 200 answer, else (None, None)."""
    if resp.status_code != 200:
        return None, None
    try:
        data = resp.json()
    except ValueError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    token, expires_in = data.get("access_token"), data.get("expires_in")
    if not isinstance(token, str) or not token:
        return None, None
    if isinstance(expires_in, bool) or not isinstance(expires_in, int | float) or expires_in <= 0:
        return None, None
    return token, float(expires_in)


def token_failure(resp: TokenAnswer) -> GatewayResult:
    """A token request that gave no token: the payment was not sent, retry later."""
    text = redact(resp.text[:264])[:200]  # masked before it is cut
    retry_after = None
    if resp.status_code == 429:
        retry_after = parse_retry_after(resp.headers.get("retry-after")) or 1.0
    log.warning("token_request_refused", status=resp.status_code, body=text)
    return GatewayResult(
        outcome=Outcome.RETRY,
        http_status=resp.status_code,
        reason=f"token_{_error_code(resp) or 'error'}",
        retry_after=retry_after,
        error=f"token request: HTTP {resp.status_code}: {text}",
        sent=False,  # no payment request left without a token
    )


def _error_code(resp: TokenAnswer) -> str | None:
    try:
        data = resp.json()
    except ValueError:
        return None
    code = data.get("error") if isinstance(data, dict) else None
    return code if isinstance(code, str) else None
