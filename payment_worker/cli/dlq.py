"""``dlq``: the dead-letter tooling for on-call, as ``celery -A payment_worker dlq ...`` (the
``celery.commands`` entry point) and as ``payment-worker dlq ...`` (the same click group).

- ``dlq list [--reason R] [--account A] [--since 1h] [--status open|replayed|resolved|all]
  [--json]``
- ``dlq show ID [--json]``
- ``dlq replay ID... | --all [--reason R] [--account A] [--dry-run] [--yes]``
- ``dlq resolve ID... --as succeeded|failed --note "..." [--by NAME]``

Bad input (an unknown id, an unknown reason, an item that is not dead, a missing ``--as``, a
malformed ``--since``) is one line on stderr and exit code 2, with nothing changed. Replay
puts a dead item back to ``unknown``: the next holder looks it up under its original key and
sends again (same key) only on a 404 within the key trust; an item in doubt for longer is
refused ("will not resend: key retention passed, resolve by hand").
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import click
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from payment_worker import embedded, runtime
from payment_worker.cli.common import database_error, json_text
from payment_worker.db import dead_letters as store
from payment_worker.domain.statuses import DeadReason
from payment_worker.errors import PaymentWorkerError
from payment_worker.ops.logging import get_logger
from payment_worker.ops.redaction import mask_account_number, redact, redact_strings
from payment_worker.runtime import Runtime
from payment_worker.settings import load_settings

__all__ = ["dlq", "mask_account_number", "parse_duration"]

log = get_logger("dlq")

REASONS = (*(r.value for r in DeadReason), store.TASK_CRASHED)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
# the longest --since taken: a century (Postgres's interval arithmetic refuses far more)
_MAX_SINCE = 100 * 365 * 86400.0
# dead-letter ids are Postgres bigints
_MAX_ID = 2**63 - 1

F = TypeVar("F", bound=Callable[..., Any])


class BadInput(PaymentWorkerError):
    """One line for on-call; exit code 2, nothing changed."""


def parse_duration(value: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``2d``, ``1w`` in seconds."""
    m = _DURATION.match(value)
    if m is None:
        raise BadInput(f"malformed --since {value!r}: use e.g. 90s, 15m, 1h, 2d")
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds > _MAX_SINCE:
        raise BadInput(f"--since {value!r} is longer than a century")
    return seconds


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


@dataclass
class _State:
    """What the subcommands share: the runtime, built on first use."""

    _rt: Runtime | None = None

    def runtime(self) -> Runtime:
        if self._rt is None:
            s = load_settings()  # a bad setting: one line, exit code 2
            missing = embedded.missing_for(s.database_url, s.redis_url)
            if missing:
                raise embedded.EmbeddedNotInstalled(missing)
            from payment_worker.ops.logging import configure_from_settings

            configure_from_settings(s)
            self._rt = runtime.install(Runtime(s))
        return self._rt

    def connect(self) -> Connection:
        return self.runtime().engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def _fail(cmd: str, message: str, code: int = 2) -> NoReturn:
    click.echo(f"dlq {cmd}: {message}", err=True)
    sys.exit(code)


def _guard(cmd: str) -> Callable[[F], F]:
    """Turn BadInput (and the set-up's failures) into one line and exit code 2."""

    def wrap(f: F) -> F:
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return f(*args, **kwargs)
            except BadInput as exc:
                _fail(cmd, str(exc))
            except embedded.EmbeddedError as exc:
                _fail(cmd, str(exc))
            except SQLAlchemyError as exc:
                # the database is down or refused: not bad input. Nothing is half-done: each
                # item is one statement, and replay and resolve report each item as it ran, so
                # the lines above this one are the items that were changed
                _fail(cmd, database_error(exc), 1)

        inner.__name__ = f.__name__
        inner.__doc__ = f.__doc__
        return inner  # type: ignore[return-value]

    return wrap


def _state(ctx: click.Context) -> _State:
    st = ctx.find_object(_State)
    if st is None:  # pragma: no cover - the group always sets it
        raise RuntimeError("dlq: no state")
    return st


def _check_reason(reason: str | None) -> None:
    if reason is not None and reason not in REASONS:
        raise BadInput(f"unknown reason {reason!r}: one of {', '.join(REASONS)}")


def _ids(values: Sequence[str]) -> list[int]:
    out: list[int] = []
    for v in values:
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses
        if not (v.isascii() and v.isdigit()) or int(v) > _MAX_ID:
            raise BadInput(f"not a dead-letter id: {v!r}")
        out.append(int(v))
    return list(dict.fromkeys(out))


@click.group(name="dlq", help="Dead letters: list, show, replay, resolve (docs/processing.md).")
@click.pass_context
def dlq(ctx: click.Context) -> None:
    # under celery, ctx.obj is Celery's CLIContext (its app is ours: -A payment_worker); the
    # subcommands get their own state, and the runtime is released when the command ends
    state = _State()
    ctx.obj = state
    ctx.call_on_close(runtime.reset)


# ---- list ---------------------------------------------------------------------------------


def _row_json(d: store.DeadLetter) -> dict[str, Any]:
    out = store.as_json(d)
    benef = out.pop("beneficiary", None) or {}
    out["beneficiary_account"] = (
        mask_account_number(benef.get("account_number")) if isinstance(benef, dict) else "-"
    )
    last_error = (d.row["payload"] or {}).get("last_error") or d.row["last_error"]
    out["last_error"] = None if last_error is None else redact(str(last_error))
    if isinstance(out.get("payload"), dict) and "last_error" in out["payload"]:
        # the payload keeps its own copy of the error text
        out["payload"] = {**out["payload"], "last_error": out["last_error"]}
    # text typed by a person or received in a message: masked as the logs mask it
    if out.get("resolution_note") is not None:
        out["resolution_note"] = redact(str(out["resolution_note"]))
    if isinstance(out.get("payload"), dict) and "args" in out["payload"]:
        out["payload"] = {**out["payload"], "args": redact_strings(out["payload"]["args"])}
    return out


def _cell(value: object, width: int | None = None) -> str:
    text = "-" if value is None else str(value).replace("\n", " ")
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return text


@dlq.command(name="list")
@click.option("--reason", default=None, help="only this reason")
@click.option("--account", default=None, help="only this account")
@click.option(
    "--since",
    default=None,
    help="only items that died within this (90s, 15m, 1h, 2d), again after a replay included",
)
@click.option("--status", "state", default="open", help="open (default), replayed, resolved, all")
@click.option("--json", "as_json", is_flag=True, help="a JSON array instead of a table")
@click.pass_context
@_guard("list")
def list_cmd(
    ctx: click.Context,
    reason: str | None,
    account: str | None,
    since: str | None,
    state: str,
    as_json: bool,
) -> None:
    """Dead letters, with counts by reason."""
    _check_reason(reason)
    if state not in store.STATES:
        raise BadInput(f"unknown --status {state!r}: one of {', '.join(store.STATES)}")
    since_s = None if since is None else parse_duration(since)
    with _state(ctx).connect() as conn:
        rows = store.list_dead_letters(
            conn, state=state, reason=reason, account_id=account, since_seconds=since_s
        )
    if as_json:
        click.echo(json_text([_row_json(d) for d in rows], default=str))
        return
    headers = ("ID", "ACCOUNT", "TRANSACTION", "REASON", "ATTEMPTS", "AGE", "BENEFICIARY")
    cells = []
    for d in rows:
        r = d.row
        benef = r["beneficiary"] if isinstance(r["beneficiary"], dict) else {}
        cells.append(
            (
                str(d.id),
                _cell(r["account_id"] or (r["payload"] or {}).get("task_name")),
                _cell(r["transaction_id"] or r["batch_id"]),
                d.reason,
                _cell(r["attempts"] if r["attempts"] is not None else r["dl_attempts"]),
                _age(r["age"]),
                mask_account_number(benef.get("account_number")) if benef else "-",
                _cell(_row_json(d)["last_error"], 60),
            )
        )
    all_headers = (*headers, "LAST_ERROR")
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(all_headers)]
    for line in [all_headers, *cells]:
        click.echo(
            "  ".join(
                v.rjust(w) if i in (0, 4) else v.ljust(w)
                for i, (v, w) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
        )
    counts = Counter(d.reason for d in rows)
    summary = ", ".join(f"{r}={n}" for r, n in sorted(counts.items())) or "none"
    click.echo(f"\n{len(rows)} dead letter(s) ({state}): {summary}")


# ---- show ---------------------------------------------------------------------------------


def _would(conn: Connection, rt: Runtime, d: store.DeadLetter) -> str:
    refusal = store.replay_refusal(conn, d.id, rt.settings.key_trust_seconds)
    if refusal is None:
        return store.LOOK_UP_FIRST
    return f"nothing: {refusal.detail}"


@dlq.command(name="show")
@click.argument("dead_letter_id")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of text")
@click.pass_context
@_guard("show")
def show_cmd(ctx: click.Context, dead_letter_id: str, as_json: bool) -> None:
    """Everything known about one dead letter, and what a replay would do now."""
    [dl_id] = _ids([dead_letter_id])
    st = _state(ctx)
    with st.connect() as conn:
        d = store.get_dead_letter(conn, dl_id)
        if d is None:
            raise BadInput(f"no dead letter {dl_id}")
        would = _would(conn, st.runtime(), d)
    out = _row_json(d)
    out["replay_would"] = would
    if as_json:
        click.echo(json_text(out, default=str))
        return
    r = d.row
    payload = r["payload"] or {}
    lines = [
        ("dead letter", f"{d.id}  reason {d.reason}  state {d.state}  age {_age(r['age'])}"),
        ("account", r["account_id"] or r["batch_account_id"]),
        ("transaction", r["transaction_id"]),
        ("status", r["tx_status"]),
        ("batch", f"{r['batch_id']} ({r['batch_status']})" if r["batch_id"] else None),
        ("amount", f"{r['amount']} {r['currency']}" if r["amount"] is not None else None),
        ("beneficiary", out["beneficiary_account"]),
        ("attempts", r["attempts"] if r["attempts"] is not None else r["dl_attempts"]),
        ("lookups", r["lookups"]),
        ("last error", out["last_error"]),
        ("error class", r["error_class"]),
        ("idempotency key", r["idempotency_key"] or payload.get("idempotency_key")),
        ("key status", r["key_status"]),
        (
            "in doubt since",
            f"{r['doubt_since']} ({_age(r['doubt_age'])} ago)" if r["doubt_since"] else "never",
        ),
        ("replays", f"{r['replay_count']} (last {r['replayed_at'] or '-'})"),
        (
            "resolved",
            f"{r['resolved_at']} by {r['resolved_by']}: {out['resolution_note']}"
            if r["resolved_at"]
            else None,
        ),
        ("task", payload.get("task_name")),
        ("task args", json.dumps(out["payload"]["args"]) if "args" in payload else None),
        ("replay would", would),
    ]
    for label, value in lines:
        if value is not None:
            click.echo(f"{label + ':':17} {value}")
    for h in payload.get("replays", []):
        click.echo(f"{'replayed:':17} {h.get('at')} by {h.get('by')} ({h.get('reason')})")


# ---- replay -------------------------------------------------------------------------------


def _who(by: str | None) -> str:
    return by or os.environ.get("USER") or os.environ.get("LOGNAME") or "unknown"


@dlq.command(name="replay")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="every open dead letter (with the filters)")
@click.option("--reason", default=None, help="with --all: only this reason")
@click.option("--account", default=None, help="with --all: only this account")
@click.option("--dry-run", is_flag=True, help="say what would happen, change nothing")
@click.option("--yes", is_flag=True, help="no confirmation for more than one item")
@click.pass_context
@_guard("replay")
def replay_cmd(
    ctx: click.Context,
    ids: tuple[str, ...],
    all_: bool,
    reason: str | None,
    account: str | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Put dead items back (looked up first, sent again only if never applied) and enqueue
    their accounts."""
    from payment_worker.ops.metrics import DEAD_LETTERS_REPLAYED
    from payment_worker.worker.queueing import enqueue_batch

    _check_reason(reason)
    if bool(ids) == all_:
        raise BadInput("name dead-letter IDs, or --all")
    if ids and (reason or account):
        raise BadInput("--reason and --account go with --all")
    st = _state(ctx)
    rt = st.runtime()
    trust = rt.settings.key_trust_seconds
    with st.connect() as conn:
        if all_:
            rows = store.list_dead_letters(conn, state="open", reason=reason, account_id=account)
            targets = [d for d in rows if d.row["transaction_pk"] is not None]
        else:
            targets = []
            for dl_id in _ids(ids):
                d = store.get_dead_letter(conn, dl_id)
                if d is None:
                    raise BadInput(f"no dead letter {dl_id}")
                refusal = store.replay_refusal(conn, dl_id, trust)
                if refusal is not None and refusal.result not in (
                    store.KEY_EXPIRED,
                    store.NOT_REPLAYABLE,
                ):
                    raise BadInput(f"{dl_id}: {refusal.detail}")
                targets.append(d)
        if not targets:
            click.echo("nothing to replay")
            return
        if dry_run:
            for d in targets:
                click.echo(f"{d.id}: would {_would(conn, rt, d)}  [{d.reason}]")
            click.echo(f"dry run: {len(targets)} item(s), nothing changed")
            return
        if len(targets) > 1 and not yes:
            try:
                ok = click.confirm(f"replay {len(targets)} dead letters?", default=False)
            except click.Abort:
                _fail(
                    "replay",
                    f"{len(targets)} items need a confirmation and stdin gave none; "
                    "nothing replayed (use --yes)",
                )
            if not ok:
                _fail("replay", "not confirmed; nothing replayed", 1)
        by = _who(None)
        reasons = {d.id: d.reason for d in targets}
        enqueued: set[str] = set()
        counts: Counter[str] = Counter()
        results = []
        # each item is its own statement, reported (line, log, metric, enqueue) as soon as it
        # ran: a database error part-way stops the run with every item before it shown
        for d in targets:
            r = store.replay(conn, d.id, trust, by)
            results.append(r)
            counts[r.result] += 1
            if r.result != store.REPLAYED:
                log.warning(
                    "dead_letter_replay_refused",
                    dead_letter_id=r.dead_letter_id,
                    result=r.result,
                    detail=r.detail,
                )
                click.echo(f"{r.dead_letter_id}: not replayed: {r.detail}")
                continue
            DEAD_LETTERS_REPLAYED.labels(reasons[r.dead_letter_id]).inc()
            log.info(
                "dead_letter_replayed",
                dead_letter_id=r.dead_letter_id,
                reason=reasons[r.dead_letter_id],
                account_id=r.account_id,
                batch_id=r.batch_id,
                by=by,
            )
            note = ""
            if r.batch_id and r.batch_id not in enqueued:
                try:
                    enqueue_batch(r.batch_id, rt=rt, account_id=r.account_id)
                    enqueued.add(r.batch_id)
                except Exception as exc:
                    note = f" (enqueue failed, the sweeper will pick it up: {exc})"
            click.echo(f"{r.dead_letter_id}: replayed, account {r.account_id}: {r.detail}{note}")
    summary = ", ".join(f"{k}={n}" for k, n in sorted(counts.items()))
    click.echo(f"{len(results)} item(s): {summary}; {len(enqueued)} batch(es) enqueued")
    if counts[store.REPLAYED] != len(results):
        sys.exit(1)


# ---- resolve ------------------------------------------------------------------------------


@dlq.command(name="resolve")
@click.argument("ids", nargs=-1)
@click.option("--as", "as_status", default=None, help="succeeded or failed (required)")
@click.option("--note", default=None, help="why (required)")
@click.option("--by", default=None, help="who (default: $USER)")
@click.pass_context
@_guard("resolve")
def resolve_cmd(
    ctx: click.Context,
    ids: tuple[str, ...],
    as_status: str | None,
    note: str | None,
    by: str | None,
) -> None:
    """Close dead items by hand as succeeded or failed (nothing is sent)."""
    from payment_worker.ops.metrics import DEAD_LETTERS_RESOLVED

    if not ids:
        raise BadInput("name one or more dead-letter IDs")
    if as_status not in ("succeeded", "failed"):
        raise BadInput("--as succeeded|failed is required")
    if not note or not note.strip():
        raise BadInput('--note "..." is required')
    wanted = _ids(ids)
    who = _who(by)
    st = _state(ctx)
    with st.connect() as conn:
        found = []
        for dl_id in wanted:
            d = store.get_dead_letter(conn, dl_id)
            if d is None:
                raise BadInput(f"no dead letter {dl_id}")
            if d.state != "open":
                raise BadInput(f"{dl_id}: not open ({d.state}, {d.row['tx_status'] or '-'})")
            found.append(d)
        failed = 0
        for d in found:
            result = store.resolve(conn, d.id, as_status, note, who)
            if result == store.RESOLVED:
                DEAD_LETTERS_RESOLVED.labels(d.reason).inc()
                log.info(
                    "dead_letter_resolved",
                    dead_letter_id=d.id,
                    reason=d.reason,
                    resolved_as=as_status,
                    by=who,
                )
                click.echo(f"{d.id}: resolved as {as_status} by {who}")
            else:
                failed += 1
                click.echo(f"{d.id}: not resolved: no longer dead")
    click.echo(f"{len(found) - failed} resolved, {failed} not")
    if failed:
        sys.exit(1)


def main(argv: Sequence[str]) -> int:
    """``payment-worker dlq ...``: run the click group on the remaining arguments."""
    try:
        dlq.main(args=list(argv), prog_name="payment-worker dlq", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
