"""Masking of what must never be printed: passwords in URLs, account numbers, known secrets.

Every place that prints or logs a URL, a gateway error body or a stored error goes through
these functions (docs/logging.md, "What is masked"). They are pure (``re`` only), so the
gateway's answer table can use them and the log processors stay cheap.

* **Passwords in URLs**: the password of a URL's user info (``scheme://user:PASSWORD@host``)
  and the value of a ``password=`` query parameter (libpq's form) become ``***``; the rest
  of the URL is kept as written (host, port, database, ``host=`` of a unix socket), so it
  still tells where the service is. A password must be percent-encoded in a URL (RFC 3986;
  libpq and redis-py require it too): a raw ``/`` or ``@`` inside one ends the URL's user
  info early, for every parser.
* **Account-number-like digit runs** (:func:`mask_account_numbers`): 8 or more digits,
  where single spaces or hyphens may separate the digits (``1234 5678 9012``,
  ``123-456789-01``), not touching a letter, digit or underscore on either side; and IBANs
  (two capital letters, two digits, then 11 to 30 capital letters or digits, optionally in
  groups separated by single spaces or hyphens). Every digit or letter of such a run but
  the last four becomes ``*``; separators stay. Shorter runs (amounts in minor units up
  to 7 digits, years, HTTP statuses, ``tx-0001``) and runs glued to letters (``pay_00000001``
  is glued to ``_``, hex ids) are kept. A date written ``2026-11-30`` is 8 digits, and is
  masked: that errs on the safe side in an error text.
* **Known secrets** (:class:`SecretScrubber`): the values of ``GATEWAY_CLIENT_SECRET`` and
  of the passwords in the configured URLs, replaced wherever they appear in a log line. A
  value shorter than 6 characters is not scrubbed by value (it would match ordinary text);
  URL masking still hides it inside a URL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = [
    "MASK",
    "SecretScrubber",
    "mask_account_number",
    "mask_account_numbers",
    "mask_url",
    "mask_urls",
    "redact",
    "redact_strings",
    "url_password",
]

MASK = "***"
MIN_SECRET_LENGTH = 6

# scheme://user:password@ : the user info ends at the last "@" before the path, so a
# password is everything after the first ":" of the user info up to that "@"
_URL_USERINFO = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:]*:)(?P<pw>[^\s/?#]*)(?P<at>@)"
)
# libpq: postgresql:///db?host=/sock&password=..., also key=value connection strings
_QUERY_PASSWORD = re.compile(r"(?P<head>(?:[?&]|\b)password=)(?P<pw>[^&\s'\"]*)", re.I)

_ACCOUNT_RUN = re.compile(r"(?<![A-Za-z0-9_])\d(?:[ -]?\d){7,}(?![A-Za-z0-9_])")
_IBAN = re.compile(r"(?<![A-Za-z0-9_])[A-Z]{2}\d{2}(?:[ -]?[A-Z0-9]){11,30}(?![A-Za-z0-9_])")
_ALNUM = re.compile(r"[A-Za-z0-9]")


def mask_url(url: str) -> str:
    """``url`` with its password (user info, ``password=`` parameter) replaced by ``***``."""
    return mask_urls(url)


def mask_urls(text: str) -> str:
    """Every URL password in free text (an error message, a log line) replaced by ``***``."""
    if "password=" in text.lower():
        text = _QUERY_PASSWORD.sub(lambda m: m["head"] + MASK if m["pw"] else m[0], text)
    if "@" not in text:
        return text
    return _URL_USERINFO.sub(lambda m: m["head"] + MASK + m["at"], text)


def url_password(url: str | None) -> str | None:
    """The (decoded) password a URL carries, in its user info or a ``password=`` parameter."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        if parts.password:
            return unquote(parts.password)
    except ValueError:
        pass
    m = _QUERY_PASSWORD.search(url)
    return unquote(m["pw"]) if m and m["pw"] else None


def _keep_last_four(match: re.Match[str]) -> str:
    run = match[0]
    total = len(_ALNUM.findall(run))
    out, seen = [], 0
    for ch in run:
        if _ALNUM.match(ch):
            seen += 1
            out.append(ch if seen > total - 4 else "*")
        else:
            out.append(ch)
    return "".join(out)


def mask_account_numbers(text: str) -> str:
    """Account-number-like runs (8+ digits, IBANs) masked but their last four characters."""
    if not any(c.isdigit() for c in text):
        return text
    text = _IBAN.sub(_keep_last_four, text)
    return _ACCOUNT_RUN.sub(_keep_last_four, text)


def mask_account_number(number: object) -> str:
    """One account number (a beneficiary's): every character but the last four masked."""
    if number is None:
        return "-"
    s = str(number)
    return "*" * max(len(s) - 4, 0) + s[-4:]


def redact(text: str) -> str:
    """What may be shown of an error text: URL passwords and account numbers masked."""
    return mask_account_numbers(mask_urls(text))


def redact_strings(value: Any) -> Any:
    """``value`` (JSON-like: lists, dicts, scalars) with :func:`redact` applied to every
    string in it, its shape kept."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [redact_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: redact_strings(v) for k, v in value.items()}
    return value


class SecretScrubber:
    """Replaces known secret values (the gateway secret, URL passwords) in a string.

    Built once per process from the settings (``ops.logging``); values shorter than
    ``MIN_SECRET_LENGTH`` are ignored.
    """

    def __init__(self, secrets: Iterable[str | None]) -> None:
        found = {s for s in secrets if s and len(s) >= MIN_SECRET_LENGTH}
        # longest first: a secret containing another is replaced whole
        self.secrets = tuple(sorted(found, key=len, reverse=True))

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def __bool__(self) -> bool:
        return bool(self.secrets)
