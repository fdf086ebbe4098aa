"""The simulator's pure state: config validation, buckets, request checks, decisions."""

from __future__ import annotations

from typing import Any

import pytest

from payment_worker.dev.simulator import build_parser, config_from_args
from payment_worker.dev.simulator_state import (
    Bucket,
    SimConfig,
    SimState,
    check_body,
    check_key,
    retry_after_header,
)


def body(**over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "transaction_id": "tx-1",
        "amount": 5,
        "currency": "IDR",
        "beneficiary": {"bank_code": "014", "account_number": "123", "name": "B"},
    }
    out.update(over)
    return out


def test_config_update_validates_names_types_and_probabilities() -> None:
    c = SimConfig()
    c.update({"rate": 5, "max_in_flight": 3, "p_lost": 0.25})
    assert (c.rate, c.max_in_flight, c.p_lost) == (5.0, 3, 0.25)
    with pytest.raises(ValueError, match="unknown"):
        c.update({"nope": 1})
    with pytest.raises(ValueError, match="number"):
        c.update({"rate": "fast"})
    with pytest.raises(ValueError, match="probability"):
        c.update({"p503": 1.5})
    assert "secret" not in c.as_dict()


def test_flags_map_onto_the_config() -> None:
    args = build_parser().parse_args(
        ["--token-ttl", "5", "--max-in-flight", "2", "--p-slow", "0.1", "--secret", "s3"]
    )
    c = config_from_args(args)
    assert (c.token_ttl, c.max_in_flight, c.p_slow, c.secret) == (5.0, 2, 0.1, "s3")
    assert args.port == 8700 and args.host == "127.0.0.1"


def test_bucket_allows_capacity_then_refills_at_rate() -> None:
    b = Bucket(tokens=2, ts=0.0)
    assert b.take(rate=2, capacity=2, now=0.0) == 0.0
    assert b.take(rate=2, capacity=2, now=0.0) == 0.0
    assert b.take(rate=2, capacity=2, now=0.0) == pytest.approx(0.5)
    assert b.take(rate=2, capacity=2, now=0.5) == 0.0


@pytest.mark.parametrize(("seconds", "header"), [(0.01, "1"), (1.0, "1"), (1.2, "2"), (2, "2")])
def test_retry_after_is_whole_seconds_at_least_one(seconds: float, header: str) -> None:
    assert retry_after_header(seconds) == header


def test_key_and_body_checks() -> None:
    assert check_key("pw1-abc") is None
    assert check_key(None) is not None and check_key("") is not None
    assert check_key("a" * 255) is None and check_key("a" * 256) is not None
    assert check_body(body()) is None
    assert check_body(body(description=None)) is None
    for bad in (
        body(amount=0),
        body(amount=True),
        body(currency="idr"),
        body(transaction_id=""),
        body(beneficiary={"bank_code": "014", "name": "B"}),
        body(description=7),
        [],
    ):
        assert check_body(bad) is not None


def test_apply_counts_sends_and_declines_send_nothing() -> None:
    st = SimState(SimConfig(), seed=1)
    status, out = st.apply("a", body())
    assert status == 201 and out["payment_id"].startswith("pay_")
    ben = {"bank_code": "014", "account_number": "REJECT-1", "name": "B"}
    assert st.apply("a", body(transaction_id="tx-2", beneficiary=ben))[0] == 402
    assert st.ledger.as_dict(st.accounts)["sends"] == {"a/tx-1": 1}


def test_a_new_token_revokes_the_old_one() -> None:
    st = SimState(SimConfig(token_ttl=60))
    old = st.issue_token("a")
    new = st.issue_token("a")
    assert not st.token_valid("a", f"Bearer {old}")
    assert st.token_valid("a", f"Bearer {new}")
    assert not st.token_valid("b", f"Bearer {new}")
    assert not st.token_valid("a", new)  # the scheme is required
