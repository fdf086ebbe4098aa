"""What is masked, exactly (docs/logging.md "What is masked"): URL passwords, account-number-like
runs, known secrets; and the log stream applies it to every line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import httpx
import pytest

from payment_worker.gateway.outcomes import classify_create, classify_lookup, held_text
from payment_worker.ops.redaction import (
    SecretScrubber,
    mask_account_number,
    mask_account_numbers,
    mask_url,
    mask_urls,
    redact,
    url_password,
)
from tests.conftest import ROOT


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://app:s3cr%40t@db.example:5432/pay?sslmode=require",
            "postgresql://app:***@db.example:5432/pay?sslmode=require",
        ),
        ("postgresql://app:pw@/pay?host=/tmp/sock", "postgresql://app:***@/pay?host=/tmp/sock"),
        ("redis://:hunter22@localhost:6379/0", "redis://:***@localhost:6379/0"),
        ("rediss://user:p@ss@host:6380", "rediss://user:***@host:6380"),
        ("postgresql:///pay?host=/tmp&password=pw1", "postgresql:///pay?host=/tmp&password=***"),
        ("unix:///tmp/r.sock?db=0&password=pw", "unix:///tmp/r.sock?db=0&password=***"),
        # nothing to hide: unchanged
        ("postgresql://app@db:5432/pay", "postgresql://app@db:5432/pay"),
        ("http://127.0.0.1:8700", "http://127.0.0.1:8700"),
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        # not even a valid URL: the password is still found
        ("postgresql://app:pw@db:notaport/pay", "postgresql://app:***@db:notaport/pay"),
    ],
)
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_mask_urls_in_free_text() -> None:
    text = (
        "cannot reach postgresql://a:one1@h1/db and redis://:two2@h2:6379/0; "
        "dsn host=h password=three3 user=a"
    )
    assert mask_urls(text) == (
        "cannot reach postgresql://a:***@h1/db and redis://:***@h2:6379/0; "
        "dsn host=h password=*** user=a"
    )


def test_url_password() -> None:
    assert url_password("postgresql://app:s3cr%40t@db/pay") == "s3cr@t"
    assert url_password("postgresql:///pay?host=/tmp&password=pw1") == "pw1"
    assert url_password("redis://localhost:6379/0") is None
    assert url_password(None) is None


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("account 1234567890 blocked", "account ******7890 blocked"),
        ("12345678", "****5678"),
        ("card 4111 1111 1111 1111.", "card **** **** **** 1111."),
        ("acct 123-456789-01", "acct ***-****89-01"),
        (
            "beneficiary account 0000123456789012 is blocked",
            "beneficiary account ************9012 is blocked",
        ),
        ('{"account_number":"9876543210"}', '{"account_number":"******3210"}'),
        ("acct-12345678", "acct-****5678"),
        # IBANs: letters and digits, grouped or not; the last four kept
        ("iban DE89 3704 0044 0532 0130 00 ok", "iban **** **** **** **** **30 00 ok"),
        ("GB29NWBK60161331926819", "******************6819"),
        # kept: short runs, runs glued to letters or underscores, times, amounts
        ("HTTP 503: try in 1234567 ms", "HTTP 503: try in 1234567 ms"),
        ("pay_00000001_ab12cd34", "pay_00000001_ab12cd34"),
        ("tx-0001 of batch b-42", "tx-0001 of batch b-42"),
        ("sha 3f2a12345678901b", "sha 3f2a12345678901b"),
        ("at 12:30:45 amount 175000 IDR", "at 12:30:45 amount 175000 IDR"),
        ("ACC12345678", "ACC12345678"),
        ("", ""),
    ],
)
def test_mask_account_numbers(text: str, shown: str) -> None:
    assert mask_account_numbers(text) == shown


def test_mask_is_idempotent_and_never_shows_more_than_four() -> None:
    once = mask_account_numbers("to 1234567890123456 and 9999 8888 7777")
    assert mask_account_numbers(once) == once
    assert once == "to ************3456 and **** **** 7777"


def test_mask_account_number_of_a_beneficiary() -> None:
    assert mask_account_number("1234560001") == "******0001"
    assert mask_account_number("123") == "123"
    assert mask_account_number(None) == "-"


def test_redact_masks_both() -> None:
    assert redact("postgresql://u:pw@h/db rejected 12345678901") == (
        "postgresql://u:***@h/db rejected *******8901"
    )


def test_secret_scrubber() -> None:
    scrub = SecretScrubber(["topsecret-1", None, "", "abc", "topsecret-1-longer"])
    assert scrub("a topsecret-1-longer b topsecret-1 c abc") == "a *** b *** c abc"
    assert not SecretScrubber([None, "short"])


def test_gateway_bodies_are_masked_at_the_source() -> None:
    body = json.dumps(
        {
            "error": "declined",
            "reason": "beneficiary_blocked",
            "message": "beneficiary account 0012345678901 is blocked",
        }
    ).encode()
    declined = classify_create(402, httpx.Headers(), body)
    assert declined.error is not None and "*********8901" in declined.error
    assert "0012345678901" not in declined.error
    # a body cut at 300 characters right inside a number: masked before the cut
    long = ("x" * 290 + " 1234567890123456 tail").encode()
    r = classify_create(500, httpx.Headers(), long)
    assert r.error is not None and "123456" not in r.error
    # a 422 conflict's stored answer, which may echo the beneficiary
    stored = {"http_status": 201, "transaction_id": "t", "beneficiary": "987654321012"}
    found = classify_lookup(200, httpx.Headers(), json.dumps(stored).encode())
    held = held_text(found)
    assert held is not None and "987654321012" not in held and "1012" in held


def test_log_lines_are_json_and_masked() -> None:
    """A process configured like every entry point: JSON off a TTY, context merged, the
    standard library's records included, secrets and URL passwords masked, account numbers
    masked in error fields and kept in ids."""
    code = textwrap.dedent(
        """
        import logging
        from structlog.contextvars import bind_contextvars
        from payment_worker.ops.logging import configure_logging, get_logger
        configure_logging("INFO", None, ["gw-secret-value"])
        log = get_logger("t")
        bind_contextvars(task_id="t-1", batch_id="payout-2026-11-29-0001")
        log.info("one", url="postgresql://u:dbpass99@h/db", error="acct 12345678901 blocked")
        logging.getLogger("celery.x").warning("sent gw-secret-value to %s", "redis://:rpw@h/0")
        log.debug("filtered out")
        try:
            raise ValueError("password=hunter2 acct 99998888777")
        except ValueError:
            log.exception("boom")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [x["event"].split()[0] for x in lines] == ["one", "sent", "boom"]
    for x in lines:
        assert {"event", "level", "timestamp", "logger"} <= set(x)
        assert x["task_id"] == "t-1" and x["batch_id"] == "payout-2026-11-29-0001"
    assert lines[0]["url"] == "postgresql://u:***@h/db"
    assert lines[0]["error"] == "acct *******8901 blocked"
    assert lines[1]["event"] == "sent *** to redis://:***@h/0"
    assert lines[1]["level"] == "warning" and lines[1]["logger"] == "celery.x"
    assert "hunter2" not in lines[2]["exception"] and "99998888777" not in lines[2]["exception"]
    for secret in ("gw-secret-value", "dbpass99", "rpw@", "12345678901"):
        assert secret not in proc.stderr
