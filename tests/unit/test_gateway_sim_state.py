"""The simulator's pure state: config validation, buckets, request checks, decisions."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from payment_worker.dev.simulator import build_parser, config_from_args
from payment_worker.dev.simulator import main as sim_main
from payment_worker.dev.simulator_faults import (
    CREATE_FAULTS,
    LOOKUP_FAULTS,
    Answer,
    decide_create,
    outage_answer,
    random_fault,
)
from payment_worker.dev.simulator_state import (
    Bucket,
    SimConfig,
    SimState,
    Stored,
    Window,
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


# --- in-doubt faults: config, flags ---------------------------------------------------------
NEW_FIELDS = {
    "p_hold": 0.5,
    "hold_seconds": 1.5,
    "p_outage_after_apply": 0.25,
    "outage_seconds": 2.0,
    "p_html_200": 0.125,
    "key_retention_seconds": 3.0,
}


def test_every_config_field_has_a_flag() -> None:
    c = SimConfig()
    argv: list[str] = []
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        # a value other than the default, so that a flag that does nothing is caught
        new = (
            ("window" if f.name == "rate_limit" else "s3")
            if isinstance(value, str)
            else (value + 0.25 if f.name.startswith("p") else value + 1)
        )
        argv += [f"--{f.name.replace('_', '-')}", str(new)]
    parsed = config_from_args(build_parser().parse_args(argv))
    for f in dataclasses.fields(c):
        assert getattr(parsed, f.name) != getattr(c, f.name), f.name


def test_in_doubt_fault_flags_map_onto_the_config() -> None:
    argv = [x for name, v in NEW_FIELDS.items() for x in (f"--{name.replace('_', '-')}", str(v))]
    c = config_from_args(build_parser().parse_args(argv))
    assert {name: getattr(c, name) for name in NEW_FIELDS} == NEW_FIELDS
    d = SimConfig()
    assert (d.p_hold, d.p_outage_after_apply, d.p_html_200) == (0.0, 0.0, 0.0)
    assert d.key_retention_seconds == 86400.0  # the protocol's promise: at least 24 hours


def test_in_doubt_fault_fields_update_and_validate() -> None:
    c = SimConfig()
    c.update(NEW_FIELDS)
    assert {name: getattr(c, name) for name in NEW_FIELDS} == NEW_FIELDS
    assert {name: c.as_dict()[name] for name in NEW_FIELDS} == NEW_FIELDS
    c.update({"hold_seconds": 0, "outage_seconds": 0})  # 0: applied at once / no outage
    bad: list[tuple[str, Any, str]] = [
        ("p_hold", 1.5, "probability"),
        ("p_outage_after_apply", -0.1, "probability"),
        ("p_html_200", 2, "probability"),
        ("p_hold", "often", "number"),
        ("hold_seconds", -1, "seconds"),
        ("outage_seconds", float("inf"), "seconds"),
        ("hold_seconds", float("nan"), "seconds"),
        ("slow_seconds", -0.5, "seconds"),
        ("key_retention_seconds", 0, "more than 0"),
        ("key_retention_seconds", -5, "seconds"),
        ("key_retention_seconds", True, "number"),
    ]
    for name, value, why in bad:
        with pytest.raises(ValueError, match=why):
            c.update({name: value})


def test_a_bad_update_changes_nothing() -> None:
    c = SimConfig()
    with pytest.raises(ValueError):
        c.update({"p_hold": 0.5, "hold_seconds": -1})
    assert (c.p_hold, c.hold_seconds) == (0.0, 10.0)


@pytest.mark.parametrize(
    "argv",
    [["--hold-seconds", "-1"], ["--p-html-200", "1.5"], ["--key-retention-seconds", "0"]],
)
def test_a_bad_flag_value_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(argv) == 2  # before anything listens
    assert "gateway-sim:" in capsys.readouterr().out


# --- in-doubt faults: state -------------------------------------------------------------------
def _in_flight(st: SimState, key: str = "k-1", data: dict[str, Any] | None = None) -> Stored:
    entry = st.stored[("a", key)] = Stored(st.body_fingerprint(data or body()))
    return entry


def _decide(st: SimState, fault: str, **scripted: Any) -> tuple[Answer, Stored]:
    entry = _in_flight(st)
    return decide_create(st, "a", "k-1", body(), entry, {"fault": fault, **scripted}), entry


def test_a_decided_key_is_forgotten_after_the_retention() -> None:
    st = SimState(SimConfig(key_retention_seconds=60))
    entry = _in_flight(st)
    st.settle("a", body(), entry)
    assert st.stored_answer("a", "k-1") is entry
    entry.decided_at -= 61  # as if stored 61 s ago
    assert st.stored_answer("a", "k-1") is None
    assert ("a", "k-1") not in st.stored
    assert st.ledger.keys_forgotten == 1
    # a create under the forgotten key is a new payment: the transaction is paid twice
    st.settle("a", body(), _in_flight(st))
    ledger = st.ledger.as_dict(st.accounts)
    assert ledger["sends"] == {"a/tx-1": 2} and ledger["double_payments"] == ["a/tx-1"]


def test_the_retention_counts_from_the_decision_and_spares_keys_in_flight() -> None:
    st = SimState(SimConfig(key_retention_seconds=60))
    entry = _in_flight(st)
    entry.decided_at = -1e9  # in flight: a stale timestamp means nothing until decided
    assert st.stored_answer("a", "k-1") is entry
    st.settle("a", body(), entry)
    assert st.stored_answer("a", "k-1") is entry
    st.config.update({"key_retention_seconds": 1e-9})  # a runtime change applies at once
    time.sleep(0.001)
    assert st.stored_answer("a", "k-1") is None


def test_decide_create_html_200_applies_and_stores_the_real_answer() -> None:
    st = SimState(SimConfig())
    ans, entry = _decide(st, "html_200")
    assert (ans.status, ans.body, ans.after) == (200, None, None)
    assert ans.html is not None and ans.html.lstrip().startswith("<!DOCTYPE html>")
    assert entry.status == 201 and entry.body is not None
    assert entry.body["transaction_id"] == "tx-1"
    assert st.ledger.as_dict(st.accounts)["sends"] == {"a/tx-1": 1}
    assert st.ledger.faults["html_200"] == 1


def test_decide_create_outage_after_apply_applies_then_takes_the_account_down() -> None:
    st = SimState(SimConfig(outage_seconds=30))
    ans, entry = _decide(st, "outage_after_apply")
    assert (ans.status, ans.after) == (201, "outage") and entry.status == 201
    assert st.ledger.as_dict(st.accounts)["sends"] == {"a/tx-1": 1}
    assert 29 < st.outage_left("a") <= 30 and st.outage_left("b") == 0.0
    down = outage_answer(st, "a")
    assert down is not None and (down.status, down.body) == (503, {"error": "service_unavailable"})
    assert outage_answer(st, "b") is None
    assert st.ledger.faults["outage_503"] == 1
    other = SimState(SimConfig())
    _decide(other, "outage_after_apply", seconds=0)  # 0 seconds: applied and lost, no outage
    assert other.outage_left("a") == 0.0 and outage_answer(other, "a") is None
    st.reset()  # a reset ends the outage with the rest of the state
    assert st.outage_left("a") == 0.0


def test_decide_create_outage_seconds_from_the_script_win() -> None:
    st = SimState(SimConfig(outage_seconds=30))
    _decide(st, "outage_after_apply", seconds=0.5)
    assert 0 < st.outage_left("a") <= 0.5


def test_a_hold_keeps_the_key_in_flight_then_applies_it_once() -> None:
    async def run() -> None:
        st = SimState(SimConfig(hold_seconds=0.05))
        ans, entry = _decide(st, "hold")
        assert ans.after == "held"
        assert entry.status is None and entry.held and st.holds_pending() == 1
        assert st.ledger.as_dict(st.accounts)["payments_sent"] == 0
        await asyncio.sleep(0.15)
        assert entry.status == 201 and not entry.held and st.holds_pending() == 0
        assert st.ledger.as_dict(st.accounts)["sends"] == {"a/tx-1": 1}
        assert st.ledger.faults["hold"] == 1

    asyncio.run(run())


def test_a_hold_forgotten_by_a_reset_never_pays() -> None:
    st = SimState(SimConfig())
    entry = _in_flight(st)
    entry.held = True
    st.reset()
    assert not st.finish_hold("a", "k-1", body(), entry)
    assert st.ledger.as_dict(st.accounts)["payments_sent"] == 0
    fresh = _in_flight(st)  # the same key sent again after the reset: its own payment
    assert not st.finish_hold("a", "k-1", body(), entry)
    assert fresh.status is None
    assert st.finish_hold("a", "k-1", body(), fresh)
    assert st.ledger.as_dict(st.accounts)["sends"] == {"a/tx-1": 1}


@pytest.mark.parametrize(
    ("flag", "kind"),
    [
        ("p_hold", "hold"),
        ("p_outage_after_apply", "outage_after_apply"),
        ("p_html_200", "html_200"),
    ],
)
def test_random_fault_draws_the_in_doubt_faults_for_creates_only(flag: str, kind: str) -> None:
    st = SimState(SimConfig(), seed=3)
    st.config.update({flag: 1.0})
    assert random_fault(st, CREATE_FAULTS) == kind
    assert random_fault(st, LOOKUP_FAULTS) is None


@pytest.mark.parametrize(("rate", "most"), [(20.0, 20), (2.5, 2), (0.5, 1)])
def test_the_window_limit_admits_floor_rate_in_any_sliding_second(rate: float, most: int) -> None:
    w = Window()
    assert [w.take(rate, 10.0 + i * 0.001) for i in range(most)] == [0.0] * most
    # one more within that second waits until the oldest is a second back
    assert w.take(rate, 10.5) == pytest.approx(0.5)
    assert w.take(rate, 10.9999) > 0
    assert w.take(rate, 11.0) == 0.0  # a second after the first: it has left the second


def test_the_rate_limit_is_bucket_or_window() -> None:
    c = SimConfig()
    assert c.rate_limit == "bucket"
    with pytest.raises(ValueError, match="rate_limit must be one of bucket, window"):
        c.update({"rate_limit": "fixed", "rate": 5})
    assert (c.rate_limit, c.rate) == ("bucket", 20.0)  # all or nothing
    c.update({"rate_limit": "window"})
    assert c.rate_limit == "window"
