"""``payment-worker gateway-sim``: an HTTP simulator of the aggregator protocol, with faults.

Implements every row of ``docs/gateway-protocol.md`` (tokens that revoke earlier ones and
expire, per-account in-flight and rate limits with ``Retry-After``, idempotent replay, 409
while a key is in flight, 422 on reuse with another body, 402 declines, lookups) plus fault
flags (latency, 503, 500/502/504, lost and slow responses, a key held in flight, an outage
after an applied create, a proxy's HTML 200, forgotten keys). One process, state in memory
(:mod:`payment_worker.dev.simulator_state`), faults in :mod:`payment_worker.dev.simulator_faults`,
served by aiohttp.

Declines: a beneficiary ``account_number`` starting with ``REJECT`` gives 402
``beneficiary_blocked``; one starting with ``NOFUNDS`` gives 402 ``insufficient_funds``; a
beneficiary ``bank_code`` of ``BLOCKED`` gives 402 ``beneficiary_blocked`` whose body echoes
the account number in a ``message`` (what the worker must mask). A ``bank_code`` of
``UNAVAILABLE`` always gives 503 (nothing applied) with such a ``message``.

Control endpoints (not part of the protocol): ``GET /_sim/ledger``, ``POST /_sim/config``,
``POST /_sim/reset``, ``POST /_sim/script``, ``GET /_sim/requests?account_id=[&since=]``,
``GET /_sim/in_flight``, ``GET /_sim/health``. See docs/gateway.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from payment_worker.dev.simulator_faults import (
    ERROR_CODES,
    LOOKUP_FAULTS,
    RESET_AFTER,
    Answer,
    decide_create,
    outage_answer,
    random_fault,
)
from payment_worker.dev.simulator_state import (
    CREATE_ONLY_FAULTS,
    FAULTS,
    RATE_LIMITS,
    SimConfig,
    SimState,
    Stored,
    check_body,
    check_key,
    check_seconds,
    retry_after_header,
)
from payment_worker.ops.open_files import raise_open_files_limit

STATE: web.AppKey[SimState] = web.AppKey("state", SimState)


Inner = Callable[[web.Request, SimState, str, dict[str, Any] | None], Awaitable[Answer]]


def _rate_limited(retry_after: str) -> Answer:
    return Answer(429, {"error": "rate_limited"}, {"Retry-After": retry_after})


def _bad(detail: str) -> Answer:
    return Answer(400, {"error": "invalid_request", "detail": detail})


def _respond(ans: Answer) -> web.Response:
    if ans.html is not None:
        return web.Response(
            status=ans.status, text=ans.html, content_type="text/html", headers=ans.headers
        )
    if ans.body is None:
        return web.Response(status=ans.status, headers=ans.headers)
    return web.json_response(ans.body, status=ans.status, headers=ans.headers)


# --- protocol endpoints -------------------------------------------------------------------
async def token(request: web.Request) -> web.StreamResponse:
    """``POST /oauth/token``: issue a token, revoking the account's earlier ones."""
    st = request.app[STATE]
    st.ledger.requests["token"] += 1
    try:
        body = json.loads(await request.read())
    except ValueError:
        body = None
    if not isinstance(body, dict) or body.get("grant_type") != "client_credentials":
        return _respond(_bad("grant_type must be client_credentials"))
    client_id = body.get("client_id")
    if not isinstance(client_id, str) or not client_id:
        return _respond(_bad("client_id must be the account id"))
    entry: list[Any] = [round(st.now(), 6), "token", 0]
    acct = st.begin(client_id)
    acct.log.append(entry)
    try:
        return await _answer(
            request, st, entry, await _token(st, client_id, body.get("client_secret"))
        )
    finally:
        st.end(client_id, acct)


async def _answer(
    request: web.Request, st: SimState, entry: list[Any], ans: Answer
) -> web.StreamResponse:
    """Log ``ans`` in the account's ``entry`` and the ledger, then write it: late for a
    slow one, never (the connection reset) for the :data:`RESET_AFTER` ones."""
    entry[2] = ans.after if ans.after in RESET_AFTER else ans.status
    st.ledger.statuses[str(entry[2])] += 1
    if ans.after == "slow":
        await asyncio.sleep(st.config.slow_seconds)
    elif ans.after in RESET_AFTER:
        _reset_connection(request)
        return web.Response(status=204)  # never written: the connection is gone
    return _respond(ans)


async def _token(st: SimState, account_id: str, secret: Any) -> Answer:
    c = st.config
    await asyncio.sleep(st.latency())
    if not isinstance(secret, str) or secret != c.secret:
        st.ledger.http_401_invalid_client += 1
        return Answer(401, {"error": "invalid_client"})
    scripted = st.next_scripted(account_id, "token")
    if scripted is not None and scripted["fault"] != "429":
        st.ledger.faults[scripted["fault"]] += 1  # (a 429 is counted as one, below)
    if scripted is not None and scripted["fault"] in ("lost", "slow"):
        # issued (every earlier token of the account revoked at once), and the answer never
        # comes (the connection reset) or comes late: what a client must survive without
        # a 401 per request or a stampede of token requests
        ans = _issued(st, account_id)
        ans.after = scripted["fault"]
        return ans
    if scripted is not None and scripted["fault"] != "429":
        code = int(scripted["fault"]) if scripted["fault"].isdigit() else 500
        # a 504 has no body (the protocol's "timeout, reset connection, 504": none)
        return Answer(code, None if code == 504 else {"error": ERROR_CODES.get(code, "error")})
    wait = st.token_rate_wait(account_id)
    if scripted is not None or wait > 0:
        st.ledger.http_429["scripted" if scripted else "token"] += 1
        seconds = float(scripted.get("retry_after", 1)) if scripted else wait
        return _rate_limited(retry_after_header(seconds))
    return _issued(st, account_id)


def _issued(st: SimState, account_id: str) -> Answer:
    """A new token for the account (its earlier ones revoked), as a 200 answer."""
    ttl = st.config.token_ttl
    return Answer(
        200,
        {
            "access_token": st.issue_token(account_id),
            "token_type": "Bearer",
            "expires_in": int(ttl) if float(ttl).is_integer() else ttl,
        },
    )


async def create_payment(request: web.Request) -> web.StreamResponse:
    """``POST /v1/accounts/{account_id}/payments``."""
    return await _account_call(request, "create", _create)


async def lookup_payment(request: web.Request) -> web.StreamResponse:
    """``GET /v1/accounts/{account_id}/payments/{key}``."""
    return await _account_call(request, "lookup", _lookup)


async def _account_call(request: web.Request, endpoint: str, inner: Inner) -> web.StreamResponse:
    st = request.app[STATE]
    account_id = request.match_info["account_id"]
    # a request is in flight once it has fully arrived (as behind a buffering proxy): a
    # client frozen halfway through sending one (SIGSTOP) holds no account slot meanwhile
    await request.read()
    st.ledger.requests[endpoint] += 1
    entry: list[Any] = [round(st.now(), 6), endpoint, 0]
    acct = st.begin(account_id)
    acct.log.append(entry)
    ans: Answer | None = None
    try:
        # an account in an outage answers before anything else (its backend is down), so it
        # neither checks tokens nor spends the account's rate or in-flight allowance
        ans = outage_answer(st, account_id) or await _guarded(
            request, st, account_id, endpoint, inner
        )
        if ans.status == 401:
            st.ledger.http_401 += 1  # (the token endpoint's invalid_client is counted apart)
        return await _answer(request, st, entry, ans)
    finally:
        if ans is not None and ans.slot is not None:
            ans.slot.in_flight -= 1
            ans.slot.late_in_flight -= 1
        st.end(account_id, acct)


async def _guarded(
    request: web.Request, st: SimState, account_id: str, endpoint: str, inner: Inner
) -> Answer:
    """Authentication, then the account's in-flight and rate limits, then the endpoint."""
    if not st.token_valid(account_id, request.headers.get("Authorization")):
        return Answer(401, {"error": "invalid_token"})
    acct = st.account(account_id)
    acct.in_flight += 1
    acct.max_in_flight_seen = max(acct.max_in_flight_seen, acct.in_flight)
    ans: Answer | None = None
    try:
        if acct.in_flight > st.config.max_in_flight:
            # "concurrency_late": admitted but for a late answer still to come, which its
            # client may have stopped waiting for (a read timeout); "concurrency": the client
            # itself sent more at once than the account allows
            late = acct.in_flight - acct.late_in_flight <= st.config.max_in_flight
            st.ledger.http_429["concurrency_late" if late else "concurrency"] += 1
            return _rate_limited("1")
        wait = st.rate_wait(account_id)
        if wait > 0:
            st.ledger.http_429["rate"] += 1
            return _rate_limited(retry_after_header(wait))
        scripted = st.next_scripted(account_id, endpoint)
        if scripted is not None and scripted["fault"] == "429":
            st.ledger.http_429["scripted"] += 1
            return _rate_limited(retry_after_header(float(scripted.get("retry_after", 1))))
        ans = await inner(request, st, account_id, scripted)
        return ans
    finally:
        if ans is not None and ans.after == "slow":
            # applied, answered late: the request is in flight until its answer is written
            # (_account_call gives the slot back then), as at a gateway that is slow to answer
            acct.late_in_flight += 1
            ans.slot = acct
        else:
            acct.in_flight -= 1


async def _create(
    request: web.Request, st: SimState, account_id: str, scripted: dict[str, Any] | None
) -> Answer:
    key = request.headers.get("Idempotency-Key")
    why = check_key(key)
    if why is not None or key is None:
        return _bad(why or "missing Idempotency-Key header")
    try:
        body = json.loads(await request.read())
    except ValueError:
        return _bad("body is not JSON")
    why = check_body(body)
    if why is not None:
        return _bad(why)
    fp = st.body_fingerprint(body)
    stored = st.stored_answer(account_id, key)
    if stored is not None:
        if stored.status is None:
            return Answer(409, {"error": "idempotency_key_in_use"})
        if stored.fingerprint != fp:
            return Answer(422, {"error": "idempotency_key_reused"})
        replay_status = 200 if stored.status == 201 else stored.status
        return Answer(replay_status, stored.body, {"Idempotent-Replayed": "true"})
    entry = st.stored[(account_id, key)] = Stored(fp)  # in flight from here until decided
    await asyncio.sleep(st.latency())
    return decide_create(st, account_id, key, body, entry, scripted)


async def _lookup(
    request: web.Request, st: SimState, account_id: str, scripted: dict[str, Any] | None
) -> Answer:
    await asyncio.sleep(st.latency())
    fault = scripted["fault"] if scripted is not None else random_fault(st, LOOKUP_FAULTS)
    if fault is not None:
        st.ledger.faults[fault] += 1
    if fault in ("503", "500", "502"):
        return Answer(int(fault), {"error": ERROR_CODES[int(fault)]})
    if fault == "504":
        return Answer(504, None)
    stored = st.stored_answer(account_id, request.match_info["key"])
    if stored is None:
        ans = Answer(404, {"error": "not_found"})
    elif stored.status is None or stored.body is None:
        ans = Answer(409, {"error": "idempotency_key_in_use"})
    else:
        ans = Answer(200, {**stored.body, "http_status": stored.status})
    if fault in ("lost", "slow"):
        ans.after = fault
    return ans


def _reset_connection(request: web.Request) -> None:
    """Drop the connection with a TCP reset: the client gets no answer at all."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


# --- control endpoints --------------------------------------------------------------------
async def sim_ledger(request: web.Request) -> web.Response:
    """``GET /_sim/ledger``: sends per transaction, tokens, 401s, 429s, request counts."""
    st = request.app[STATE]
    out = st.ledger.as_dict(st.accounts)
    out["holds_pending"] = st.holds_pending()
    out["accounts_in_flight"] = st.accounts_in_flight
    out["max_accounts_in_flight"] = st.max_accounts_in_flight
    out["config"] = st.config.as_dict()
    return web.json_response(out)


async def sim_config(request: web.Request) -> web.Response:
    """``POST /_sim/config``: change fault flags and limits at runtime."""
    st = request.app[STATE]
    try:
        values = json.loads(await request.read())
        if not isinstance(values, dict):
            raise ValueError("expected a JSON object")
        st.config.update(values)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(st.config.as_dict())


async def sim_reset(request: web.Request) -> web.Response:
    """``POST /_sim/reset``: forget tokens, payments, scripts and the ledger (config stays)."""
    request.app[STATE].reset()
    return web.json_response({"reset": True})


async def sim_script(request: web.Request) -> web.Response:
    """``POST /_sim/script``: queue forced answers for an account's next requests.

    Body: ``{"account_id": "a", "answers": [{"fault": "429", "retry_after": 2,
    "endpoint": "create"}]}``; fault is one of 429, 503, 500, 502, 504, lost, slow, hold,
    outage_after_apply, html_200; endpoint is create, lookup, token or any (the last three
    faults: create only, the default for them); ``applied`` (bool) for 500/502/504;
    ``seconds`` for hold and outage_after_apply (else the config's).
    """
    st = request.app[STATE]
    try:
        data = json.loads(await request.read())
        account_id, answers = data["account_id"], data["answers"]
        for a in answers:
            _check_scripted(a)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return web.json_response({"error": f"bad script: {exc}"}, status=400)
    st.account(str(account_id)).script.extend(answers)
    return web.json_response({"queued": len(st.account(str(account_id)).script)})


def _check_scripted(answer: dict[str, Any]) -> None:
    """Validate one scripted answer in place (the fault as a string); ValueError if bad."""
    fault = answer["fault"] = str(answer.get("fault"))
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}")
    # these decide what happens to a payment: on a lookup or a token request they mean nothing
    if fault in CREATE_ONLY_FAULTS and answer.setdefault("endpoint", "create") != "create":
        raise ValueError(f"fault {fault} is for endpoint create only")
    if answer.get("seconds") is not None:
        answer["seconds"] = check_seconds("seconds", answer["seconds"])


async def sim_requests(request: web.Request) -> web.Response:
    """``GET /_sim/requests?account_id=[&since=t]``: the account's requests as
    [t, endpoint, status], only those after ``since`` (simulator clock) when given."""
    st = request.app[STATE]
    acct = st.accounts.get(request.query.get("account_id", ""))
    log = list(acct.log) if acct else []
    since = request.query.get("since")
    if since is not None:
        try:
            after = float(since)
        except ValueError:
            return web.json_response({"error": "since must be a number"}, status=400)
        log = [entry for entry in log if entry[0] > after]
    return web.json_response({"now": st.now(), "requests": log})


async def sim_in_flight(request: web.Request) -> web.Response:
    """``GET /_sim/in_flight``: accounts with a request in progress, now and at most (cheap
    enough to poll while a benchmark runs, unlike the ledger)."""
    st = request.app[STATE]
    return web.json_response(
        {"now": st.accounts_in_flight, "max": st.max_accounts_in_flight, "t": st.now()}
    )


async def sim_health(_: web.Request) -> web.Response:
    """``GET /_sim/health``."""
    return web.json_response({"ok": True})


def build_app(config: SimConfig, seed: int | None = None) -> web.Application:
    """The simulator's aiohttp application."""
    app = web.Application()
    app[STATE] = SimState(config, seed)
    app.router.add_post("/oauth/token", token)
    app.router.add_post("/v1/accounts/{account_id}/payments", create_payment)
    app.router.add_get("/v1/accounts/{account_id}/payments/{key}", lookup_payment)
    app.router.add_get("/_sim/ledger", sim_ledger)
    app.router.add_post("/_sim/config", sim_config)
    app.router.add_post("/_sim/reset", sim_reset)
    app.router.add_post("/_sim/script", sim_script)
    app.router.add_get("/_sim/requests", sim_requests)
    app.router.add_get("/_sim/in_flight", sim_in_flight)
    app.router.add_get("/_sim/health", sim_health)
    return app


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``payment-worker gateway-sim``."""
    d = SimConfig()
    p = argparse.ArgumentParser(prog="payment-worker gateway-sim", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8700, help="0 picks a free port")
    p.add_argument("--secret", default=d.secret, help="client secret of every account")
    p.add_argument("--token-ttl", type=float, default=d.token_ttl, help="token lifetime, s")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight, help="per account")
    p.add_argument("--rate", type=float, default=d.rate, help="requests/s per account")
    p.add_argument(
        "--rate-limit",
        choices=RATE_LIMITS,
        default=d.rate_limit,
        help="bucket: a token bucket of --rate capacity; window: at most --rate in any second",
    )
    p.add_argument("--token-rate", type=float, default=d.token_rate, help="token requests/s")
    p.add_argument("--latency-ms", type=float, default=d.latency_ms)
    p.add_argument("--latency-jitter-ms", type=float, default=d.latency_jitter_ms)
    p.add_argument("--p503", type=float, default=d.p503, help="503, nothing applied")
    p.add_argument("--p500", type=float, default=d.p500, help="500, maybe applied")
    p.add_argument("--p502", type=float, default=d.p502, help="502, maybe applied")
    p.add_argument("--p504", type=float, default=d.p504, help="504 without body, maybe applied")
    p.add_argument("--p-fault-applied", type=float, default=d.p_fault_applied)
    p.add_argument("--p-lost", type=float, default=d.p_lost, help="applied, connection reset")
    p.add_argument("--p-slow", type=float, default=d.p_slow, help="applied, answered late")
    p.add_argument("--slow-seconds", type=float, default=d.slow_seconds)
    p.add_argument(
        "--p-hold", type=float, default=d.p_hold, help="key held in flight (409), then applied"
    )
    p.add_argument("--hold-seconds", type=float, default=d.hold_seconds)
    p.add_argument(
        "--p-outage-after-apply",
        type=float,
        default=d.p_outage_after_apply,
        help="applied, connection reset, then the account answers 503",
    )
    p.add_argument("--outage-seconds", type=float, default=d.outage_seconds)
    p.add_argument(
        "--p-html-200", type=float, default=d.p_html_200, help="applied, answered 200 text/html"
    )
    p.add_argument(
        "--key-retention-seconds",
        type=float,
        default=d.key_retention_seconds,
        help="a decided key is forgotten this long after (lookup 404, create pays again)",
    )
    p.add_argument("--seed", type=int, default=None)
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """A SimConfig from parsed flags (validated like ``POST /_sim/config``)."""
    cfg = SimConfig()
    # every config field has its flag (tests/unit/test_gateway_sim_state.py checks it)
    cfg.update({f.name: getattr(args, f.name) for f in dataclasses.fields(cfg)})
    return cfg


async def serve(host: str, port: int, config: SimConfig, seed: int | None = None) -> None:
    """Serve until SIGTERM or SIGINT; prints the ready line once listening."""
    raise_open_files_limit()
    runner = web.AppRunner(build_app(config, seed), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, shutdown_timeout=1.0)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    print(f"gateway-sim listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    """Entry point of ``payment-worker gateway-sim``."""
    import os

    from payment_worker.ops.logging import configure_logging

    args = build_parser().parse_args(argv)
    # the service's log format (LOG_LEVEL, LOG_JSON), without the service's other settings:
    # the simulator needs none of them
    json_env = os.environ.get("LOG_JSON", "").strip().lower()
    configure_logging(
        os.environ.get("LOG_LEVEL", "INFO"),
        None if json_env in ("", "auto") else json_env in ("1", "true", "yes", "on"),
        [args.secret],
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"gateway-sim: {exc}")
        return 2
    asyncio.run(serve(args.host, args.port, config, args.seed))
    return 0
