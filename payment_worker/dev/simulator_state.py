"""The gateway simulator's in-memory state: config, accounts, stored answers, ledger.

No HTTP here (see :mod:`payment_worker.dev.simulator`); the event loop runs one
handler at a time between awaits, so plain dicts need no locks.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from payment_worker.domain.idempotency import fingerprint

# scriptable only on creates: each one decides what happens to a payment
CREATE_ONLY_FAULTS = ("hold", "outage_after_apply", "html_200")
# how ``SimConfig.rate`` is counted (``Bucket``, ``Window``)
RATE_LIMITS = ("bucket", "window")
# kinds of answers ``POST /_sim/script`` can force
FAULTS = ("429", "503", "500", "502", "504", "lost", "slow", *CREATE_ONLY_FAULTS)
_CURRENCY = re.compile(r"^[A-Z]{3}$")


@dataclass
class SimConfig:
    """Behaviour knobs; every one can be changed at runtime through ``POST /_sim/config``."""

    token_ttl: float = 300.0  # seconds a token lives (expires_in)
    max_in_flight: int = 1  # concurrent requests per account before 429
    rate: float = 20.0  # requests/s per account (payments and lookups) before 429
    # how the rate is counted: "bucket", a token bucket of `rate` capacity (lenient: up to
    # twice the rate in a second after a quiet one), or "window", at most floor(rate) (at
    # least 1) requests in any sliding second (the protocol's words read to the letter)
    rate_limit: str = "bucket"
    token_rate: float = 10.0  # token requests/s per account before 429
    latency_ms: float = 0.0  # mean processing latency
    latency_jitter_ms: float = 0.0  # uniform +- around the mean
    p503: float = 0.0  # probability of a 503, nothing applied
    p500: float = 0.0  # probability of a 500 (applied with p_fault_applied)
    p502: float = 0.0  # probability of a 502 (applied with p_fault_applied)
    p504: float = 0.0  # probability of a 504 without body (applied with p_fault_applied)
    p_fault_applied: float = 0.5  # share of 500/502/504 where the payment was applied
    p_lost: float = 0.0  # probability that a payment is applied and the connection reset
    p_slow: float = 0.0  # probability that a payment is applied and answered late
    slow_seconds: float = 10.0  # how late a slow answer comes
    # in-doubt faults (docs/gateway.md, "Faults"): a create held in flight, then applied
    # with its answer lost; applied and lost, then an account outage; a proxy's HTML 200
    p_hold: float = 0.0  # probability that a create is held in flight (409s), then applied
    hold_seconds: float = 10.0  # how long a held key stays in flight
    p_outage_after_apply: float = 0.0  # probability: applied, reset, then the account is down
    outage_seconds: float = 10.0  # how long the account answers 503 after such a create
    p_html_200: float = 0.0  # probability: applied, answered 200 text/html (a broken proxy)
    key_retention_seconds: float = 86400.0  # a decided key is forgotten this long after
    secret: str = "sim-secret"  # the client secret every account must present

    def update(self, values: dict[str, Any]) -> None:
        """Set fields from a JSON object; raises ValueError on unknown names or bad values.

        All or nothing: one bad value leaves every field as it was.
        """
        names = {f.name for f in dataclasses.fields(self)}
        checked: dict[str, Any] = {}
        for key, value in values.items():
            if key not in names:
                raise ValueError(f"unknown config field {key!r}")
            current = getattr(self, key)
            if isinstance(current, str):
                if not isinstance(value, str):
                    raise ValueError(f"{key} must be a string")
                if key == "rate_limit" and value not in RATE_LIMITS:
                    raise ValueError(f"{key} must be one of {', '.join(RATE_LIMITS)}")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number")
            elif key.startswith("p") and not 0 <= value <= 1:
                raise ValueError(f"{key} must be a probability")
            elif key.endswith("_seconds"):
                check_seconds(key, value)
            if key == "key_retention_seconds" and value <= 0:
                # 0 would forget every answer at once: no replay or lookup could ever work
                raise ValueError(f"{key} must be more than 0")
            checked[key] = type(current)(value)
        for key, value in checked.items():
            setattr(self, key, value)

    def as_dict(self) -> dict[str, Any]:
        """The config as JSON, without the secret."""
        out = dataclasses.asdict(self)
        out.pop("secret")
        return out


@dataclass
class Bucket:
    """A token bucket of ``capacity`` refilled at ``rate``/s (one per account and limit)."""

    tokens: float
    ts: float

    def take(self, rate: float, capacity: float, now: float) -> float:
        """0.0 when a token was taken, else the seconds until one is there."""
        self.tokens = min(capacity, self.tokens + (now - self.ts) * rate)
        self.ts = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / rate


@dataclass
class Window:
    """At most ``floor(rate)`` (at least 1) requests admitted in any sliding second."""

    admitted: deque[float] = field(default_factory=deque)

    def take(self, rate: float, now: float) -> float:
        """0.0 when the request is admitted, else the seconds until the oldest leaves."""
        while self.admitted and self.admitted[0] <= now - 1.0:
            self.admitted.popleft()
        if len(self.admitted) < max(1, int(rate + 1e-9)):
            self.admitted.append(now)
            return 0.0
        return self.admitted[0] + 1.0 - now


@dataclass
class Account:
    """Per-account gateway state."""

    token: str | None = None
    token_expires: float = 0.0
    in_flight: int = 0
    # of in_flight: requests decided whose answer is still to come ("slow": a payment applied,
    # or a lookup answered); their client may have given up waiting, but the gateway is not
    # done with the request until it answers
    late_in_flight: int = 0
    max_in_flight_seen: int = 0
    bucket: Bucket | None = None
    window: Window = field(default_factory=Window)
    token_bucket: Bucket | None = None
    script: deque[dict[str, Any]] = field(default_factory=deque)
    log: deque[list[Any]] = field(default_factory=lambda: deque(maxlen=5000))
    outage_until: float = 0.0  # monotonic time until which the account answers 503
    active: int = 0  # requests of any endpoint (token included) in progress right now


@dataclass
class Stored:
    """What the gateway keeps under one (account, Idempotency-Key)."""

    fingerprint: str
    status: int | None = None  # None while in flight
    body: dict[str, Any] | None = None
    decided_at: float = 0.0  # monotonic time the answer was stored (retention counts from it)
    held: bool = False  # in flight because of a hold fault, applied when the hold ends


@dataclass
class Ledger:
    """What happened, for the tests: sends per transaction, tokens, 401s, 429s."""

    sends: Counter[str] = field(default_factory=Counter)
    tokens_issued: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    http_401: int = 0
    http_401_invalid_client: int = 0
    http_429: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)  # injected faults by kind
    keys_forgotten: int = 0  # stored answers dropped for being older than the retention

    def as_dict(self, accounts: dict[str, Account]) -> dict[str, Any]:
        """The ledger as JSON."""
        return {
            "sends": dict(self.sends),
            "double_payments": sorted(k for k, n in self.sends.items() if n > 1),
            "payments_sent": sum(self.sends.values()),
            "tokens_issued": sum(self.tokens_issued.values()),
            "tokens_issued_per_account": dict(self.tokens_issued),
            "http_401": self.http_401,
            "http_401_invalid_client": self.http_401_invalid_client,
            "http_429": sum(self.http_429.values()),
            "http_429_by_cause": {
                c: self.http_429[c]
                for c in ("concurrency", "concurrency_late", "rate", "token", "scripted")
            },
            "max_in_flight_seen": {a: s.max_in_flight_seen for a, s in accounts.items()},
            "requests": {**self.requests, "total": sum(self.requests.values())},
            "statuses": dict(self.statuses),
            "faults": dict(self.faults),
            "keys_forgotten": self.keys_forgotten,
        }


class SimState:
    """All simulator state, reset by ``POST /_sim/reset`` (the config survives a reset)."""

    def __init__(self, config: SimConfig, seed: int | None = None) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.started = time.monotonic()
        self.reset()

    def reset(self) -> None:
        """Forget tokens, stored answers, scripts and the ledger."""
        self.accounts: dict[str, Account] = {}
        self.stored: dict[tuple[str, str], Stored] = {}
        self.ledger = Ledger()
        self._seq = 0
        # distinct accounts with a request in progress (any endpoint), now and at most since
        # the reset: how many accounts a worker fleet really holds in flight at once
        self.accounts_in_flight = 0
        self.max_accounts_in_flight = 0

    def begin(self, account_id: str) -> Account:
        """A request of the account starts (pair with :meth:`end`)."""
        acct = self.account(account_id)
        acct.active += 1
        if acct.active == 1:
            self.accounts_in_flight += 1
            self.max_accounts_in_flight = max(self.max_accounts_in_flight, self.accounts_in_flight)
        return acct

    def end(self, account_id: str, acct: Account) -> None:
        """A request that :meth:`begin` counted is over (answered or dropped)."""
        acct.active -= 1
        # a request that started before a reset belongs to the forgotten accounts
        if acct.active == 0 and self.accounts.get(account_id) is acct:
            self.accounts_in_flight -= 1

    def account(self, account_id: str) -> Account:
        """The state of an account, created on first sight."""
        acct = self.accounts.get(account_id)
        if acct is None:
            acct = self.accounts[account_id] = Account()
        return acct

    def now(self) -> float:
        """Seconds on the simulator's monotonic clock (the request log's time base)."""
        return time.monotonic() - self.started

    # --- tokens -----------------------------------------------------------------------
    def issue_token(self, account_id: str) -> str:
        """A new token for the account; every earlier one is revoked at once."""
        acct = self.account(account_id)
        acct.token = secrets.token_urlsafe(24)
        acct.token_expires = time.monotonic() + self.config.token_ttl
        self.ledger.tokens_issued[account_id] += 1
        return acct.token

    def token_valid(self, account_id: str, authorization: str | None) -> bool:
        """True when the header carries the account's current, unexpired token."""
        acct = self.accounts.get(account_id)
        if acct is None or acct.token is None or not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        return (
            scheme.lower() == "bearer"
            and secrets.compare_digest(value.strip(), acct.token)
            and time.monotonic() < acct.token_expires
        )

    def token_rate_wait(self, account_id: str) -> float:
        """0.0 if a token request is within the account's token quota, else seconds to wait."""
        acct = self.account(account_id)
        rate = self.config.token_rate
        if acct.token_bucket is None:
            acct.token_bucket = Bucket(max(1.0, rate), time.monotonic())
        return acct.token_bucket.take(rate, max(1.0, rate), time.monotonic())

    # --- limits -----------------------------------------------------------------------
    def rate_wait(self, account_id: str) -> float:
        """0.0 if the request is within the account's quota, else seconds to wait."""
        acct = self.account(account_id)
        rate = self.config.rate
        if self.config.rate_limit == "window":
            return acct.window.take(rate, time.monotonic())
        if acct.bucket is None:
            acct.bucket = Bucket(max(1.0, rate), time.monotonic())
        return acct.bucket.take(rate, max(1.0, rate), time.monotonic())

    def next_scripted(self, account_id: str, endpoint: str) -> dict[str, Any] | None:
        """The next scripted answer of the account for this endpoint, consumed."""
        acct = self.accounts.get(account_id)
        if acct is None or not acct.script:
            return None
        head = acct.script[0]
        if head.get("endpoint", "any") in ("any", endpoint):
            return acct.script.popleft()
        return None

    def latency(self) -> float:
        """Seconds of simulated processing time for one request."""
        c = self.config
        if c.latency_ms <= 0 and c.latency_jitter_ms <= 0:
            return 0.0
        jitter = self.rng.uniform(-c.latency_jitter_ms, c.latency_jitter_ms)
        return max(0.0, c.latency_ms + jitter) / 1000.0

    def draw(self, p: float) -> bool:
        """True with probability ``p``."""
        return p > 0 and self.rng.random() < p

    # --- payments ---------------------------------------------------------------------
    def apply(self, account_id: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Decide a new payment: send the money (201) or decline it (402)."""
        number = str(body["beneficiary"]["account_number"])
        if number.startswith("REJECT"):
            return 402, {"error": "declined", "reason": "beneficiary_blocked"}
        if body["beneficiary"].get("bank_code") == "BLOCKED":
            # as some real gateways do: the answer echoes the account number (the worker
            # must mask it wherever it stores, logs or shows the body)
            return 402, {
                "error": "declined",
                "reason": "beneficiary_blocked",
                "message": f"beneficiary account {number} is blocked",
            }
        if number.startswith("NOFUNDS"):
            return 402, {"error": "declined", "reason": "insufficient_funds"}
        self._seq += 1
        self.ledger.sends[f"{account_id}/{body['transaction_id']}"] += 1
        return 201, {
            "payment_id": f"pay_{self._seq:08d}_{secrets.token_hex(4)}",
            "status": "succeeded",
            "transaction_id": body["transaction_id"],
            "amount": body["amount"],
            "currency": body["currency"],
        }

    def settle(
        self, account_id: str, body: dict[str, Any], entry: Stored
    ) -> tuple[int, dict[str, Any]]:
        """Decide the payment in flight under ``entry``, store its answer there, return it."""
        status, answer = self.apply(account_id, body)
        entry.status, entry.body = status, answer
        entry.decided_at = time.monotonic()
        entry.held = False
        return status, answer

    def stored_answer(self, account_id: str, key: str) -> Stored | None:
        """What is stored under the key, forgetting an answer older than the retention.

        Forgotten lazily, on the next request that asks: the protocol only promises that a
        key is kept for the retention, and a lookup or create is the only way to tell.
        A key still in flight is never forgotten.
        """
        skey = (account_id, key)
        entry = self.stored.get(skey)
        if entry is None or entry.status is None:
            return entry
        if time.monotonic() - entry.decided_at > self.config.key_retention_seconds:
            del self.stored[skey]
            self.ledger.keys_forgotten += 1
            return None
        return entry

    def finish_hold(self, account_id: str, key: str, body: dict[str, Any], entry: Stored) -> bool:
        """The end of a hold: apply the payment held under the key; False if reset since."""
        if self.stored.get((account_id, key)) is not entry:
            return False  # a reset forgot it: that payment never happened
        self.settle(account_id, body, entry)
        return True

    def holds_pending(self) -> int:
        """Keys held in flight whose payment is not applied yet."""
        return sum(1 for entry in self.stored.values() if entry.held)

    # --- outages ----------------------------------------------------------------------
    def start_outage(self, account_id: str, seconds: float) -> None:
        """From now on, for ``seconds``, the account answers 503 to creates and lookups."""
        acct = self.account(account_id)
        acct.outage_until = max(acct.outage_until, time.monotonic() + seconds)

    def outage_left(self, account_id: str) -> float:
        """Seconds left of the account's outage, 0.0 when it is up."""
        acct = self.accounts.get(account_id)
        if acct is None:
            return 0.0
        return max(0.0, acct.outage_until - time.monotonic())

    @staticmethod
    def body_fingerprint(body: dict[str, Any]) -> str:
        """The fingerprint that tells "same body" from "another body" under one key."""
        return fingerprint(body)


def retry_after_header(seconds: float) -> str:
    """``Retry-After`` in whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def check_seconds(name: str, value: Any) -> float:
    """``value`` as seconds: a finite number, at least 0; ValueError naming ``name`` if not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds, at least 0")
    return float(value)


def check_key(key: str | None) -> str | None:
    """Why an Idempotency-Key is invalid, or None when it is fine."""
    if key is None:
        return "missing Idempotency-Key header"
    if not 1 <= len(key) <= 255 or not all(0x20 <= ord(c) <= 0x7E for c in key):
        return "Idempotency-Key must be 1 to 255 printable ASCII characters"
    return None


def check_body(body: Any) -> str | None:
    """Why a create-payment body is malformed, or None when it is fine."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    tx = body.get("transaction_id")
    if not isinstance(tx, str) or not 1 <= len(tx) <= 255:
        return "transaction_id must be a non-empty string"
    amount = body.get("amount")
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        return "amount must be a positive integer (minor units)"
    currency = body.get("currency")
    if not isinstance(currency, str) or not _CURRENCY.match(currency):
        return "currency must be a 3-letter ISO code"
    ben = body.get("beneficiary")
    if not isinstance(ben, dict):
        return "beneficiary must be an object"
    for name in ("bank_code", "account_number", "name"):
        if not isinstance(ben.get(name), str) or not ben[name]:
            return f"beneficiary.{name} must be a non-empty string"
    desc = body.get("description")
    if desc is not None and not isinstance(desc, str):
        return "description must be a string"
    return None
