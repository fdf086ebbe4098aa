"""The gateway simulator's faults: which one a request draws, and what it does to a payment.

Used by :mod:`payment_worker.dev.simulator` once a create is in flight under its key (the
HTTP side: resets, late answers, the HTML body, lives there). Every fault ends in an answer
the protocol lists, or in no answer at all, except ``html_200``, which models a broken
proxy in front of the gateway. See docs/gateway.md, "Faults".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from payment_worker.dev.simulator_state import Account, SimState, Stored

# faults a create can draw, and a lookup (which applies nothing, so only trouble answers)
LOOKUP_FAULTS = ("503", "500", "502", "504")
CREATE_FAULTS = (*LOOKUP_FAULTS, "lost", "slow", "hold", "outage_after_apply", "html_200")
ERROR_CODES = {500: "internal_error", 502: "bad_gateway", 503: "service_unavailable"}
# answers after which the connection is reset instead of written (the client gets nothing)
RESET_AFTER = ("lost", "held", "outage")
# what a misbehaving proxy (a WAF or captive page) puts in place of the gateway's JSON
HTML_200 = (
    "<!DOCTYPE html>\n<html><head><title>OK</title></head>"
    "<body><h1>Request accepted</h1><p>Your request has been forwarded.</p></body></html>\n"
)


@dataclass
class Answer:
    """A protocol answer.

    ``after`` marks the ones not written as they are: "slow" (answered late), and the
    :data:`RESET_AFTER` ones (connection reset). ``html`` replaces the JSON body.
    ``slot``: the account whose in-flight slot a late answer holds until it is written.
    """

    status: int
    body: dict[str, Any] | None
    headers: dict[str, str] = field(default_factory=dict)
    after: str | None = None
    html: str | None = None
    slot: Account | None = None


def random_fault(st: SimState, kinds: tuple[str, ...]) -> str | None:
    """At most one fault per request, by one uniform draw over the configured probabilities."""
    c = st.config
    probs = {"503": c.p503, "500": c.p500, "502": c.p502, "504": c.p504}
    probs.update({"lost": c.p_lost, "slow": c.p_slow, "hold": c.p_hold})
    probs.update({"outage_after_apply": c.p_outage_after_apply, "html_200": c.p_html_200})
    if not any(probs[k] > 0 for k in kinds):
        return None
    r, acc = st.rng.random(), 0.0
    for kind in kinds:
        acc += probs[kind]
        if r < acc:
            return kind
    return None


def outage_answer(st: SimState, account_id: str) -> Answer | None:
    """503 while the account is in an outage (after ``outage_after_apply``), else None."""
    if st.outage_left(account_id) <= 0:
        return None
    st.ledger.faults["outage_503"] += 1
    return Answer(503, {"error": ERROR_CODES[503]})


def decide_create(
    st: SimState,
    account_id: str,
    key: str,
    body: dict[str, Any],
    entry: Stored,
    scripted: dict[str, Any] | None,
) -> Answer:
    """Decide a create in flight under ``entry``: a fault (drawn or scripted) or the payment."""
    fault = scripted["fault"] if scripted is not None else random_fault(st, CREATE_FAULTS)
    if fault is not None:
        st.ledger.faults[fault] += 1
    skey = (account_id, key)
    if fault == "503":
        st.stored.pop(skey, None)
        return Answer(503, {"error": ERROR_CODES[503]})
    beneficiary = body["beneficiary"]
    if beneficiary.get("bank_code") == "UNAVAILABLE":
        # the beneficiary's bank is down (nothing applied), and the answer echoes the account
        # number, as some real gateways do: what the worker must mask
        st.stored.pop(skey, None)
        number = beneficiary.get("account_number")
        return Answer(
            503,
            {"error": ERROR_CODES[503], "message": f"bank of account {number} is unreachable"},
        )
    if fault in ("500", "502", "504"):
        if scripted is not None and "applied" in scripted:
            applied = bool(scripted["applied"])
        else:
            applied = st.draw(st.config.p_fault_applied)
        if applied:
            st.settle(account_id, body, entry)
        else:
            st.stored.pop(skey, None)
        code = int(fault)
        return Answer(code, None if code == 504 else {"error": ERROR_CODES[code]})
    seconds = scripted.get("seconds") if scripted is not None else None
    if fault == "hold":
        hold(st, account_id, key, body, entry, _seconds(seconds, st.config.hold_seconds))
        # never written (the connection is reset): what the key answers while held
        return Answer(409, {"error": "idempotency_key_in_use"}, after="held")
    status, stored_body = st.settle(account_id, body, entry)
    if fault == "outage_after_apply":
        st.start_outage(account_id, _seconds(seconds, st.config.outage_seconds))
        return Answer(status, stored_body, after="outage")
    if fault == "html_200":
        # the proxy replaced whatever the gateway said; the gateway stored its real answer
        return Answer(200, None, html=HTML_200)
    return Answer(status, stored_body, after=fault if fault in ("lost", "slow") else None)


def hold(
    st: SimState, account_id: str, key: str, body: dict[str, Any], entry: Stored, seconds: float
) -> None:
    """Keep the key in flight for ``seconds`` (creates and lookups get 409), then apply it.

    The request that started it gets no answer (its connection is reset): the gateway
    went on processing after the client gave up, as a gateway that is slow past the
    client's timeout does. Nobody ever sees the payment's own answer, only a lookup or a
    replay after the hold.
    """
    entry.held = True
    loop = asyncio.get_running_loop()
    loop.call_later(seconds, st.finish_hold, account_id, key, body, entry)


def _seconds(scripted: Any, default: float) -> float:
    return default if scripted is None else float(scripted)
