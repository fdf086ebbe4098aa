"""Shared access tokens per account: one refresh at a time, ahead of expiry, no stampede.

The protocol revokes every earlier token of an account when it issues a new one, so the
token is shared by every worker process through Redis and refreshed by one of them at a
time, under a short owner-checked lock:

- ``{prefix}:token:{account}``: a hash (``token``, ``lead_ms``) whose Redis TTL is the
  token's remaining lifetime (counted from before the token request was sent, less a
  transit margin), so validity is judged on the Redis server's clock.
- ``{prefix}:token-lock:{account}``: the refresh lock, ``SET NX PX`` with a random owner
  value, released and written through only by its owner (Lua compare-and-delete).

A token is refreshed once its remaining lifetime drops below ``lead_ms``: a share of its
lifetime drawn per token between half and all of ``GATEWAY_TOKEN_REFRESH_FRACTION``, so
that many accounts issued together do not all come due together. While one process
refreshes, the others keep using the current token if it is still valid, or wait for the
new one. After a 401 the client calls :meth:`TokenManager.get` with ``rejected`` set to
the token that failed: a refresh happens only if that token is still the cached one.

A lock holder's drain takes the refresh lock in its start script (:meth:`TokenManager.started`)
and sends the token request before its first claim (:meth:`TokenManager.prefetch`): the
gateway's latency is spent while Postgres answers, and the first :meth:`TokenManager.get`
reads the answer.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import redis

from payment_worker import lua
from payment_worker.gateway.outcomes import (
    PACED,
    GatewayResult,
    classify_transport_error,
    not_sent,
)
from payment_worker.gateway.token_answer import TokenAnswer, parse_token, token_failure
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import GATEWAY_TOKEN_REFRESHES
from payment_worker.redis_keys import RedisKeys

log = get_logger("gateway.tokens")

# a process-local copy of a token is dropped this long before the token comes due
_LOCAL_MARGIN_MS = 100

# A token request that got no token pauses the account's token requests in this process:
# 1 s, doubled with each failure in a row up to 30 s, longer when the answer's Retry-After
# says so (the protocol: wait at least Retry-After; honoured up to RETRY_AFTER_MAX_SECONDS,
# as a payment's is). Every payment or lookup of the account meanwhile is "not sent",
# due again when the pause ends. Without it each item of a chunk asked again at once: one
# holder sent about 400 token requests a second for an account whose credentials the
# gateway refused.
_PAUSE_FIRST = 1.0
_PAUSE_MAX = 30.0
#: the reason of a result returned during such a pause (its error names the failure)
TOKEN_PAUSED = "token_paused"
TOKEN_WAIT_TIMEOUT = "token_wait_timeout"

# read the token and take the refresh lock in one step; store a token (and release the lock)
# only while holding it; release the lock when nothing was stored. All owner-checked.
_CLAIM = lua.load("token_claim")
_RELEASE = lua.load("token_release")
_STORE = lua.load("token_store")


@dataclass(frozen=True, slots=True)
class CachedToken:
    """A token read from Redis with its remaining lifetime."""

    token: str
    remaining_ms: int
    lead_ms: int

    @property
    def due(self) -> bool:
        """True once the token should be refreshed ahead of expiry."""
        return self.remaining_ms <= self.lead_ms


TokenFetcher = Callable[[str], TokenAnswer]


@dataclass(frozen=True, slots=True)
class SentRequest:
    """A token request already sent, its answer not read yet (:meth:`TokenManager.prefetch`).
    ``read`` returns the answer or raises httpx's transport errors; it is called once."""

    sent_at: float  # time.monotonic() before the request left: the token's lifetime starts after
    read: Callable[[], TokenAnswer]


#: sends an account's ``POST /oauth/token`` now; the answer is read later
TokenSender = Callable[[str], SentRequest]


@dataclass(frozen=True, slots=True)
class _Pause:
    """Token requests of an account paused after ``failures`` failed ones in a row, until
    ``until`` (time.monotonic()); ``error`` is the last failure's."""

    until: float
    failures: int
    error: str
    # the token in Redis that ended the pause early (below): if the gateway refuses it, it
    # is the one the failed request may have revoked, and the pause comes back
    ended_by: str | None = None
    # a token the gateway refused after it ended the last pause: read again from Redis, it
    # does not end this one (each item would send it and meet a 401)
    refused: str | None = None


@dataclass(slots=True)
class _Started:
    """A refresh lock the holder's start took: its owner value, and the token request sent
    under it (:meth:`TokenManager.prefetch`), if any."""

    owner: str
    sent: SentRequest | None = None


class TokenManager:
    """Gets an account's shared token from Redis, refreshing it through the gateway when due.

    Thread-safe; one per process is enough. ``fetch`` performs ``POST /oauth/token`` for an
    account and returns the raw response (the client owns the HTTP connection pool);
    ``send``, when given, sends it without waiting for the answer (:meth:`prefetch`), and
    ``fetch`` may then be left out: it is ``send`` with its answer read at once.
    """

    def __init__(
        self,
        redis_client: redis.Redis,
        fetch: TokenFetcher | None = None,
        prefix: str = "pw",
        refresh_fraction: float = 0.2,
        lock_ttl: float = 10.0,
        poll_interval: float = 0.01,
        send: TokenSender | None = None,
        retry_after_max: float = 300.0,
    ) -> None:
        if fetch is None:
            if send is None:
                raise ValueError("a TokenManager needs fetch or send")
            sender = send

            def fetch(account_id: str) -> TokenAnswer:
                return sender(account_id).read()

        self._redis = redis_client
        self._fetch = fetch
        self._send = send
        self._keys = RedisKeys(prefix)
        self._fraction = refresh_fraction
        self._lock_ttl_ms = max(1000, int(lock_ttl * 1000))
        self._poll = poll_interval
        self._retry_after_max = retry_after_max
        self._claim = redis_client.register_script(_CLAIM)
        self._release = redis_client.register_script(_RELEASE)
        self._store = redis_client.register_script(_STORE)
        self._rng = random.Random()
        # account -> (token, monotonic time it comes due). Until then no process refreshes
        # it (all judge "due" by the same lead stored with the token), so reading Redis on
        # every call would only cost a round trip; a 401 bypasses this copy.
        self._local: dict[str, tuple[str, float]] = {}
        # account -> a refresh lock taken at the lock holder's start (account_start.lua) and
        # not yet used: the next get() refreshes under it, reading the answer of the token
        # request already sent under it, if any
        self._started: dict[str, _Started] = {}
        # account -> its token requests paused after a failure (see _PAUSE_FIRST)
        self._paused: dict[str, _Pause] = {}

    # --- keys ---------------------------------------------------------------------------
    def token_key(self, account_id: str) -> str:
        """The Redis key of an account's shared token."""
        return self._keys.token(account_id)

    def lock_key(self, account_id: str) -> str:
        """The Redis key of an account's refresh lock."""
        return self._keys.token_lock(account_id)

    # --- reading ----------------------------------------------------------------------
    def cached(self, account_id: str) -> CachedToken | None:
        """The account's current shared token, or None when there is none or it expired."""
        # one round trip; no MULTI needed: a key that expires in between reads as "none"
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(self.token_key(account_id), ["token", "lead_ms"])
        pipe.pttl(self.token_key(account_id))
        (token, lead), pttl = pipe.execute()
        if token is None or pttl is None or int(pttl) <= 0:
            return None
        found = CachedToken(_s(token), int(pttl), int(lead or 0))
        self._remember(account_id, found.token, found.remaining_ms - found.lead_ms)
        return found

    def _remember(self, account_id: str, token: str, fresh_ms: int) -> None:
        if fresh_ms > _LOCAL_MARGIN_MS:
            self._local[account_id] = (
                token,
                time.monotonic() + (fresh_ms - _LOCAL_MARGIN_MS) / 1e3,
            )
        else:
            self._local.pop(account_id, None)

    # --- read at the account lock's take (lua/account_start.lua) ---------------------------
    def start_args(self, account_id: str) -> tuple[str, int] | None:
        """The refresh lock's owner value and TTL for the start script's token read, or None
        when this process's copy of the token is fresh (nothing to read)."""
        hit = self._local.get(account_id)
        if hit is not None and time.monotonic() < hit[1]:
            return None
        if self._paused_result(account_id) is not None:
            return None  # no refresh lock taken, no request sent early: get() answers
        return secrets.token_hex(12), self._lock_ttl_ms

    def started(self, account_id: str, owner: str, reply: Sequence[Any]) -> None:
        """The start script's token answer (``token_claim.lua``'s): a token to use is kept
        as :meth:`get` keeps one; a refresh lock taken is kept for the next :meth:`get`."""
        verdict, token, pttl, lead, _cooling = reply
        if _s(verdict) == "refresh":
            self._started[account_id] = _Started(owner)
        elif _s(verdict) == "use" and token:
            self._remember(account_id, _s(token), int(pttl) - int(lead))

    def prefetch(self, account_id: str) -> bool:
        """Send the token request of a refresh lock the start took, now, without waiting:
        its answer comes while the caller does other work (the drain's first claim), and
        the next :meth:`get` reads it instead of sending one. True when a request was sent
        (or its send failed: the next :meth:`get` meets the failure as its own)."""
        started = self._started.get(account_id)
        if self._send is None or started is None or started.sent is not None:
            return False
        started.sent = self._send(account_id)
        return True

    def unused_start(self, account_id: str) -> str | None:
        """The holder is done with the account: a refresh lock its start took and it never
        used is settled. A token request already sent under it is read and its token stored,
        as a refresh would (the gateway revoked the earlier token when it issued it): None.
        One never sent: its owner value is returned, for the caller to release
        (``token_release.lua``, or the lock's release, ``lua/account_end.lua``). None too
        when there was none."""
        started = self._started.pop(account_id, None)
        if started is None:
            return None
        if started.sent is not None:
            self._refresh_owned(account_id, started.owner, started.sent)
            return None
        return started.owner

    # --- the one entry point -----------------------------------------------------------
    def get(self, account_id: str, rejected: str | None = None) -> str | GatewayResult:
        """A valid token for ``account_id``, or a not-sent result when none can be had.

        ``rejected``: a token the gateway just answered 401 to. A new token is fetched only
        if that token is still the shared one; if another worker already replaced it, the
        replacement is returned and nothing is fetched (compare and refresh).
        """
        if rejected is None:
            hit = self._local.get(account_id)
            if hit is not None and time.monotonic() < hit[1]:
                return hit[0]
        else:
            # at once: a pause that comes back below must not leave the refused token here
            # for the next item to send
            self._local.pop(account_id, None)
        paused = self._paused_result(account_id)
        if paused is not None:
            # no request now; another process may have stored a token meanwhile
            cur = None if rejected is not None else self.cached(account_id)
            pause = self._paused.get(account_id)  # (another thread may have ended it)
            if cur is None or (pause is not None and cur.token == pause.refused):
                # none, or the very token the gateway refused during this pause: one 401 per
                # item would follow
                self._local.pop(account_id, None)
                return paused
            # used, and the pause is over (its failure count kept until a token is had),
            # unless the gateway refuses this very token
            if pause is not None:
                self._paused[account_id] = replace(
                    pause, until=time.monotonic(), ended_by=cur.token
                )
            return cur.token
        if rejected is not None:
            pause = self._paused.get(account_id)
            if (
                pause is not None
                and pause.ended_by == rejected
                and time.monotonic() - pause.until <= _PAUSE_MAX
            ):
                # the token that ended a pause early was refused soon after: the failed
                # request may have been issued a new one, revoking it. Unless another process
                # stored a new token meanwhile, no token request per item (a 401 and a
                # request each) while the endpoint fails: the pause comes back
                cur = self.cached(account_id)
                if cur is not None and cur.token != rejected:
                    return cur.token
                log.info("token_refused_after_pause", account_id=account_id)
                self._pause(account_id, not_sent(TOKEN_PAUSED, pause.error), refused=rejected)
                refused = self._paused_result(account_id)
                if refused is not None:  # (None: another thread had a token meanwhile)
                    return refused
        if rejected is None:
            started = self._started.pop(account_id, None)
            if started is not None:
                # the lock holder's start took the refresh lock: no second read, and
                # perhaps its request already sent
                return self._refresh_owned(account_id, started.owner, started.sent)
        deadline = time.monotonic() + self._lock_ttl_ms / 1000.0 + 2.0
        while True:
            # one round trip: the token if it is good, else the refresh lock if free (the
            # read and the lock are one step, so no re-read is needed under the lock)
            owner = secrets.token_hex(12)
            verdict, cur, cooling_ms = self._claim_token(account_id, owner, rejected)
            if verdict == "use" and cur is not None:
                self._remember(account_id, cur.token, cur.remaining_ms - cur.lead_ms)
                return cur.token
            if verdict == "refresh":
                return self._refresh_owned(account_id, owner, rejected=rejected)
            if cur is not None and cur.token != rejected:
                # due, but someone else is refreshing (or the account cools down): it is
                # still valid
                return cur.token
            if verdict == "cooling":
                # a 429 closed the account for every process: its token request waits too
                return not_sent(
                    PACED,
                    f"account cooling down for {cooling_ms / 1000:.3f}s more (no token "
                    "request before then)",
                    retry_after=cooling_ms / 1000,
                )
            if time.monotonic() >= deadline:
                return not_sent(TOKEN_WAIT_TIMEOUT, "timed out waiting for a token refresh")
            time.sleep(self._poll)

    # --- pauses after a failed token request ---------------------------------------------
    def _paused_result(self, account_id: str) -> GatewayResult | None:
        """The not-sent answer while the account's token requests are paused, else None."""
        pause = self._paused.get(account_id)
        if pause is None:
            return None
        left = pause.until - time.monotonic()
        if left <= 0:
            if -left > _PAUSE_MAX:
                # long over: a later failure starts the backoff afresh (below), so the
                # entry goes (one per account ever paused would stay otherwise)
                self._paused.pop(account_id, None)
            return None  # over; the failure count stays until a token is had
        return not_sent(
            TOKEN_PAUSED,
            f"token requests paused for {left:.1f}s more after: {pause.error}",
            retry_after=left,
        )

    def _pause(self, account_id: str, failed: GatewayResult, refused: str | None = None) -> None:
        """A token request got no token: pause the account's next ones (see _PAUSE_FIRST).
        ``refused``: a token the gateway refused (the one that ended the last pause early,
        or the one whose 401 led to the failed request): read again, it does not end this
        one."""
        now = time.monotonic()
        before = self._paused.get(account_id)
        # "in a row": a failure long after the last pause ended starts again from 1 s
        in_row = before is not None and now - before.until <= _PAUSE_MAX
        failures = before.failures + 1 if before is not None and in_row else 1
        seconds = min(_PAUSE_FIRST * 2 ** min(failures - 1, 16), _PAUSE_MAX)
        # a Retry-After is the gateway's own word: not cut to the backoff's cap (a token
        # request asked again before it only meets another 429)
        seconds = max(seconds, min(failed.retry_after or 0.0, self._retry_after_max))
        error = failed.error or failed.error_class
        self._paused[account_id] = _Pause(now + seconds, failures, error, refused=refused)
        if refused is not None:
            # (the read that found it refused kept a copy of it)
            self._local.pop(account_id, None)
        log.info("token_requests_paused", account_id=account_id, seconds=seconds, failures=failures)

    # --- internals ----------------------------------------------------------------------
    def _refresh_owned(
        self,
        account_id: str,
        owner: str,
        sent: SentRequest | None = None,
        rejected: str | None = None,
    ) -> str | GatewayResult:
        """Refresh under the refresh lock ``owner`` holds (reading the answer of ``sent``,
        a request already sent, when given); the lock is released whatever happens (by the
        store, or here). ``rejected``: the token whose 401 led here: with no new token it
        leaves the shared hash too (every process would send it again, a 401 each)."""
        stored = False
        try:
            token, stored = self._refresh(account_id, owner, sent, rejected)
            return token
        finally:
            if not stored:
                # nothing stored (a failed request, an expired lock, an error): the lock
                # goes now, not at its TTL, so another process may try at once
                keys, args = [self.lock_key(account_id)], [owner]
                if rejected is not None:
                    # the refused token leaves the hash too, if it still holds that one
                    keys.append(self.token_key(account_id))
                    args.append(rejected)
                self._release(keys=keys, args=args)

    def _claim_token(
        self, account_id: str, owner: str, rejected: str | None
    ) -> tuple[str, CachedToken | None, int]:
        """``lua/token_claim.lua``: ("use" | "refresh" | "wait" | "cooling", the valid token
        or None, the cooldown's ms left)."""
        verdict, token, pttl, lead, cooling = self._claim(
            keys=[
                self.token_key(account_id),
                self.lock_key(account_id),
                self._keys.pace(account_id),
            ],
            args=[owner, self._lock_ttl_ms, rejected or ""],
        )
        found = CachedToken(_s(token), int(pttl), int(lead)) if token else None
        return _s(verdict), found, int(cooling)

    def _refresh(
        self,
        account_id: str,
        owner: str,
        sent: SentRequest | None = None,
        rejected: str | None = None,
    ) -> tuple[str | GatewayResult, bool]:
        """Fetch (or read the answer of ``sent``) and store a new token under the refresh
        lock ``owner`` holds; the result, and whether it was stored (the store releases the
        lock)."""
        if sent is None:
            sent = SentRequest(time.monotonic(), lambda: self._fetch(account_id))
        t0 = sent.sent_at
        try:
            resp = sent.read()
        except httpx.TransportError as exc:
            GATEWAY_TOKEN_REFRESHES.labels(result="transport_error").inc()
            res = classify_transport_error(exc)
            log.warning("token_refresh_failed", account_id=account_id, error=res.error)
            # whatever happened at the gateway, no payment was sent: retry later
            failed = not_sent(f"token_{res.reason}", f"token request: {res.error}")
            # (the refused token, read again during the pause, does not end it)
            self._pause(account_id, failed, refused=rejected)
            return failed, False
        token, expires_in = parse_token(resp)
        if token is None or expires_in is None:
            GATEWAY_TOKEN_REFRESHES.labels(result=f"http_{resp.status_code}").inc()
            failed = token_failure(resp)
            self._pause(account_id, failed, refused=rejected)
            return failed, False
        GATEWAY_TOKEN_REFRESHES.labels(result="ok").inc()
        self._paused.pop(account_id, None)
        lifetime_ms = int(expires_in * 1000)
        # the gateway's clock started at or after t0; a small margin covers request transit
        margin_ms = min(200, lifetime_ms // 50)
        elapsed_ms = int((time.monotonic() - t0) * 1000)
        ttl_ms = lifetime_ms - margin_ms - elapsed_ms
        lead_ms = int(lifetime_ms * self._fraction * self._rng.uniform(0.5, 1.0))
        stored = self._store(
            keys=[self.lock_key(account_id), self.token_key(account_id)],
            args=[owner, token, lead_ms, ttl_ms],
        )
        if stored:
            self._remember(account_id, token, ttl_ms - lead_ms)
        log.info(
            "token_refreshed",
            account_id=account_id,
            expires_in=expires_in,
            lead_ms=lead_ms,
            stored=bool(stored),
        )
        return token, bool(stored)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
