"""The periodic repair: nothing accepted may be left behind, and nothing waits long.

Finds accounts with due open items and **no live holder**: the lock's holder process has
lost its liveness key (:mod:`payment_worker.locks.liveness`; the sweeper takes the lock
away at once, owner-checked), or the lock is free and the items saw no write for
``SWEEPER_STALE_AFTER`` seconds (2 s: a fresh submission's message is on its way meanwhile).
A free account whose last message is still waiting in the broker behind a backlog, or was
waiting at the last pass that found one, less than ``SWEEPER_STALE_AFTER`` ago (taken by a
worker whose task has not taken the lock yet), is left to that message (the ``queued`` mark
against the oldest waiting message's publish time: :func:`_messages_on_their_way`,
:func:`_waited_lately`), and behind a backlog the stale period is that much longer.
Locks are read only for those stale accounts, unless a registered holder process is dead
(``liveness.dead_holders``): then for every account with due work. It enqueues one of
their batches. The horizon is therefore liveness: a killed or paused holder's accounts, a
broker that lost messages (a flush, a Redis restart without persistence), a submission made
while the broker was down, a delayed message lost with its worker, and items left
``dispatching``/``unknown`` by a crash all move again within a few seconds.
Those in-doubt items are resolved by lookup by the next lock holder, under the account lock
and its fencing token, never by the sweeper itself, so even repair cannot race a holder.

It also finds accounts with a batch left not completed although all its items are terminal
(a drain that ended by lock loss, fencing or a crash right after a full last chunk) and
enqueues them the same way: the holder that message starts completes the batch under its
fence. The sweeper writes no row of its own, so every state write stays fenced.

Where it runs: a :class:`SweeperThread` in every worker process (started by
:mod:`payment_worker.worker.lifecycle`), beside the task slots. A sweep sent as a message
would wait behind the payments backlog and every busy slot, exactly when repair matters
most; a thread needs neither a queue nor a free slot. Each thread ticks every
``SWEEPER_INTERVAL``; the first to take the interval's ``sweeper:tick`` key sweeps
(:func:`sweep_if_due`), so the fleet sweeps about once per interval however many processes
run, and the sweeper lock still keeps two passes from overlapping. Beat's periodic ``sweep``
message stays as a fallback through the same gate.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import LockError, RedisError

from payment_worker.db import stalls
from payment_worker.db.retry import short_error, transient_reason
from payment_worker.locks.liveness import (
    READ_CHUNK,
    alive_holders,
    dead_holders,
    holder_of,
    read_locks,
    take_over,
)
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    DB_RETRIES,
    LOCK_TAKEOVERS,
    SWEEP_REENQUEUED,
    SWEEP_SECONDS,
    SWEEPS,
)
from payment_worker.ops.queue_depth import oldest_enqueued_ms
from payment_worker.redis_pool import UNREACHABLE
from payment_worker.runtime import Runtime
from payment_worker.settings import Settings
from payment_worker.worker.queueing import ENQUEUED_HEADER, PAYMENTS_QUEUE, enqueue_batch

log = get_logger("sweeper")


def sweep_if_due(res: Runtime) -> dict[str, Any]:
    """One pass, unless another process has already taken this interval's: at most about
    one sweep per ``SWEEPER_INTERVAL`` across the fleet. ``{"result": "not_due"}`` then."""
    s = res.settings
    taken = res.redis.set(res.keys.sweeper_tick(), os.getpid(), nx=True, px=_tick_gap_ms(s))
    if not taken:
        return {"result": "not_due"}
    started = time.monotonic()
    try:
        return run_sweep(res)
    finally:
        _rest_after(res, time.monotonic() - started)


def _tick_gap_ms(s: Settings) -> int:
    """The interval's own gap between the fleet's passes: a little under the interval, so
    the next tick of the process that swept finds the tick key free."""
    return max(1, int(s.sweeper_interval * 800))


# after a pass, the fleet's next one waits at least this many times as long as the pass took
REST_PER_PASS_SECOND = 1.0


def _rest_after(res: Runtime, seconds: float) -> None:
    """Keep the fleet's next pass ``REST_PER_PASS_SECOND`` x ``seconds`` away when that is
    longer than the interval's own gap. A pass reads every due open item once: behind a
    backlog of a million (issue 13), about a second of one Postgres backend, which once a
    second would be that backend for good, taken from the drains' statements. So the
    sweeper takes at most about half of one backend, and its horizon grows by the pass's
    own length only when a pass outgrows the interval."""
    rest_ms = int(seconds * REST_PER_PASS_SECOND * 1000)
    if rest_ms <= _tick_gap_ms(res.settings):
        return
    try:
        pipe = res.redis.pipeline(transaction=False)
        pipe.set(res.keys.sweeper_tick(), os.getpid(), px=rest_ms)
        # the memory of waited messages must reach the pass after the rest (a no-op when
        # there is none; never shorter than it was set this pass)
        pipe.pexpire(res.keys.sweeper_waited(), rest_ms + waited_memory_ms(res.settings))
        pipe.execute()
    except RedisError as exc:  # the next tick then comes at the interval, as before
        log.warning("sweeper_rest_not_set", error=repr(exc))


class SweeperThread(threading.Thread):
    """Sweeps (:func:`sweep_if_due`) every ``interval`` seconds in a worker process.

    A daemon thread beside the task slots, so the repair path runs on time under any
    backlog. ``current`` gives the process's runtime at each tick. :meth:`stop` wakes it at
    once; a pass in progress finishes (it is bounded by the database timeouts).
    """

    def __init__(self, current: Callable[[], Runtime], interval: float) -> None:
        super().__init__(name="pw-sweeper", daemon=True)
        self._current = current
        self._interval = interval
        self._stopping = threading.Event()
        self.passes = 0  # ticks that took their interval and ran (or tried) a pass

    def run(self) -> None:
        # a random phase, then every interval (+-10 %): processes started together spread out
        delay = random.uniform(0.0, self._interval)
        while not self._stopping.wait(delay):
            delay = self._interval * random.uniform(0.9, 1.1)
            try:
                result = sweep_if_due(self._current())
            except Exception as exc:
                # the next tick tries again; a thread that died would end the repair for good
                reason = transient_reason(exc)
                if reason is None:
                    log.exception("sweeper_thread_tick_failed")
                    continue
                # a restart or a failover: the next tick is this pass's retry. Counted like
                # a drain's, since whichever statement meets a dead pooled connection first
                # invalidates the pool and the others reconnect without an error
                DB_RETRIES.labels(reason).inc()
                log.warning("db_retry", op="sweep", reason=reason, error=short_error(exc))
                continue
            if result["result"] != "not_due":
                self.passes += 1

    def stop(self, timeout: float | None = None) -> None:
        """Stop ticking; wait up to ``timeout`` seconds for a pass in progress."""
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)


def sweeper_lock_seconds(s: Settings) -> float:
    """How long a sweeper pass keeps the other passes out: two intervals (at least 1 s). A
    pass takes well under one (160 ms for 5,000 stale accounts); a killed or paused sweeper
    then delays the next pass by about one interval only."""
    return max(2 * s.sweeper_interval, 1.0)


def run_sweep(res: Runtime) -> dict[str, Any]:
    """One sweeper pass, under a Redis lock so two passes never overlap; returns a summary."""
    s = res.settings
    # redis-py's Lock: owner token, Lua release. The timeout bounds a killed or paused
    # sweeper, so it is short: a pass left hanging would stop every repair for that long. A
    # pass that outlives it may overlap the next one, which is harmless (the swept markers
    # dedup the messages, takeovers are owner-checked).
    guard = res.redis.lock(res.keys.sweeper_lock(), timeout=sweeper_lock_seconds(s), blocking=False)
    if not guard.acquire(blocking=False):
        SWEEPS.labels("skipped").inc()
        return {"result": "skipped", "reason": "another sweeper is running"}
    started = time.monotonic()
    try:
        return _sweep(res)
    finally:
        SWEEP_SECONDS.observe(time.monotonic() - started)
        try:
            guard.release()
        except LockError:
            log.warning("sweeper_lock_expired", seconds=time.monotonic() - started)


# accounts one pass looks at, at most (the stale ones first, then the oldest due); far
# above a fleet's held accounts, so live holders never crowd out a dead one
SWEEP_LIMIT = 10_000


def holder_keep_ms(s: Settings) -> int:
    """How long a silent holder stays in the registry (``liveness.dead_holders``): well past
    the lock TTL, after which none of its locks can remain, with room for a late beat
    (both sides on the Redis server's clock)."""
    return 2 * s.lock_ttl_ms + 60_000


def _sweep(res: Runtime) -> dict[str, Any]:
    s = res.settings
    # A free account counts as stale (its message lost) only after no write for
    # SWEEPER_STALE_AFTER plus the age of the oldest message still waiting: behind a backlog
    # a message waits that long, and a repair would wait behind it as well. So the query
    # returns the few accounts that may need repair, not every account of the backlog (each
    # of which would cost Redis reads, every pass).
    backlog_ms = _backlog_ms(res)
    stale = s.sweeper_stale_after + backlog_ms / 1000
    # while a registered holder is dead, every account with due work: its accounts are taken
    # over however recently they were written. Otherwise the stale ones only (a dead holder
    # that never registered is found that way too, as its accounts go stale)
    every = bool(dead_holders(res.redis, res.keys, holder_keep_ms(s)))
    with res.engine.connect() as conn:
        stalled = stalls.stalled_accounts(conn, stale, SWEEP_LIMIT, every=every)
        seen = {acct.account_id for acct in stalled}
        stalled += [
            acct
            for acct in stalls.uncompleted_batch_accounts(conn, s.sweeper_stale_after, SWEEP_LIMIT)
            if acct.account_id not in seen
        ]
    # who holds each one: one pipelined GET per account, then one EXISTS per distinct holder
    # process (a handful), so a pass costs len(stalled) + processes commands in two round trips
    values = read_locks(res.redis, res.keys, [a.account_id for a in stalled])
    holders = sorted({h for h in map(holder_of, values) if h is not None})
    alive = alive_holders(res.redis, res.keys, holders)
    # of the free, stale ones (few: held accounts are the many), whose message is on its way
    # and which a task took since the read above
    on_its_way, taken_since = _messages_on_their_way(
        res,
        [a.account_id for a, v in zip(stalled, values, strict=True) if v is None and a.stale],
        int(stale * 1000),
    )
    # the query above is a moment old by now (a slow pass under load: most of a second): an
    # account that looks free and unmarked may have been drained by a holder meanwhile, so
    # it is looked at once more, after the lock reads
    free = [
        a.account_id
        for a, v in zip(stalled, values, strict=True)
        if v is None
        and a.stale
        and not a.uncompleted
        and a.account_id not in on_its_way | taken_since
    ]
    if free:
        with res.engine.connect() as conn:
            still = stalls.still_stalled(conn, free, stale)
        drained = set(free) - still
    else:
        drained = set()
    requeued: list[str] = []
    busy = taken = queued = 0
    for acct, value in zip(stalled, values, strict=True):
        if value is None and not acct.stale:
            continue  # free and written moments ago: its message is on its way
        if value is None and acct.account_id in on_its_way:
            queued += 1  # its message waits behind the backlog: a repair would run twice
            continue
        if value is None and acct.account_id in taken_since:
            busy += 1  # a task took the lock between the two reads
            continue
        if value is None and acct.account_id in drained:
            continue  # a holder drained it since the query
        if value is not None:
            holder = holder_of(value)
            if holder is None or holder in alive:
                busy += acct.stale  # a live holder (or one only its TTL can free)
                continue
            # the holder process is dead: free the account now (if the lock still holds
            # exactly what was judged dead), then send it to a live worker below
            if not take_over(res.redis, res.keys.lock(acct.account_id), value):
                busy += acct.stale
                continue
            taken += 1
            LOCK_TAKEOVERS.labels("sweeper").inc()
            log.info("sweep_took_over", account_id=acct.account_id, dead_holder=holder)
            # whatever repair message was sent before went to the dead holder's process
            res.redis.delete(res.keys.swept(acct.account_id))
        # at most one repair message per account until its task starts (the holder deletes
        # the marker) or SWEEPER_RESEND_AFTER passes (the message was lost)
        marker = res.keys.swept(acct.account_id)
        try:
            fresh = res.redis.set(
                marker, acct.batch_id, nx=True, px=int(s.sweeper_resend_after * 1000)
            )
        except UNREACHABLE:
            # the SET may have run, only its reply lost: a marker no message stands behind
            # would hold this account's repair back for SWEEPER_RESEND_AFTER (30 s). Dropped
            # if Redis answers (at worst one repair message more); the pass ends as before
            with contextlib.suppress(RedisError):
                res.redis.delete(marker)
            raise
        if not fresh:
            continue
        try:
            enqueue_batch(acct.batch_id, rt=res, account_id=acct.account_id)
        except Exception as exc:
            res.redis.delete(marker)
            log.warning("sweep_enqueue_failed", batch_id=acct.batch_id, error=repr(exc))
            SWEEPS.labels("broker_error").inc()
            return {
                "result": "broker_error",
                "stalled": sum(a.stale for a in stalled),
                "reenqueued": requeued,
                "taken_over": taken,
            }
        requeued.append(acct.batch_id)
        SWEEP_REENQUEUED.inc()
        log.info(
            "sweep_reenqueued",
            account_id=acct.account_id,
            batch_id=acct.batch_id,
            in_doubt=acct.in_doubt,
            uncompleted=acct.uncompleted,
        )
    SWEEPS.labels("ok").inc()
    return {
        "result": "ok",
        "stalled": sum(a.stale for a in stalled),
        "busy": busy,
        "queued": queued,
        "taken_over": taken,
        "reenqueued": requeued,
    }


def _backlog_ms(res: Runtime) -> int:
    """How long the oldest message still waiting in the payments queue has waited (ms), or
    the oldest one the last pass that found one saw (:func:`_waited_lately`), whichever is
    older; 0 without a Redis broker to read, or when it cannot be read."""
    broker = res.broker_redis
    if broker is None:
        return 0
    try:
        oldest = oldest_enqueued_ms(broker, PAYMENTS_QUEUE, ENQUEUED_HEADER)
    except Exception as exc:  # the broker's own trouble: judge without the backlog
        log.warning("sweep_broker_unreadable", error=repr(exc))
        return 0
    oldest, now_ms = _waited_lately(res, oldest)
    return max(0, now_ms - oldest) if oldest is not None else 0


def server_ms(time_reply: tuple[int, int]) -> int:
    """The Redis server's clock in ms, from a ``TIME`` reply: the clock the queued marks and
    the messages' enqueued-at headers are stamped with
    (:func:`~payment_worker.worker.queueing.mark_queued`), whatever the clocks of the hosts
    that published them. Read in a pipeline the pass sends anyway."""
    seconds, micros = time_reply
    return int(seconds) * 1000 + int(micros) // 1000


def waited_memory_ms(s: Settings) -> int:
    """How long a pass remembers the oldest waiting message (:func:`_waited_lately`): the
    stale period, and two intervals more, so the next pass still finds it however the
    interval compares to the stale period (before, the stale period alone: with passes 2 s
    or more apart, the memory was gone at every pass)."""
    return max(1, int((s.sweeper_stale_after + 2 * s.sweeper_interval) * 1000))


def _waited_lately(res: Runtime, oldest: int | None) -> tuple[int | None, int]:
    """The publish time of the oldest message waiting now or at the last pass that found
    one, if that pass was less than :func:`waited_memory_ms` ago (the ``sweeper:waited`` key,
    set here while one waits: the last such pass's, not the oldest over the period, which a
    lasting backlog would keep from ever moving on).

    A message leaves the queue when a worker takes it, not when its task takes the lock:
    in a burst (hundreds of messages taken at once by threads that share the cores) that
    takes up to a second. Judged by the queue alone, the accounts of a burst just taken
    looked free, stale and unqueued the moment the queue emptied, and got a repair message
    each (26 to 57 wasted executions in a run of throughput scenario 4). A message the last
    such pass saw waiting now counts as on its way for that memory's length after it; a
    message lost since (a broker flush) is repaired that much later, at most.

    With it, the Redis server's time now (ms), read in the same round trip."""
    key = res.keys.sweeper_waited()
    try:
        pipe = res.redis.pipeline(transaction=False)
        pipe.get(key)
        if oldest is not None:
            pipe.set(key, oldest, px=waited_memory_ms(res.settings))
        pipe.time()
        answers = pipe.execute()
    except RedisError as exc:  # judge by the queue alone
        log.warning("sweep_waited_unreadable", error=repr(exc))
        # this host's clock: the server's is out of reach too (the pass's next read will say)
        return oldest, int(time.time() * 1000)
    seen, now_ms = answers[0], server_ms(answers[-1])
    if seen is None or not seen.isdigit():
        return oldest, now_ms
    return (int(seen) if oldest is None else min(int(seen), oldest)), now_ms


def _messages_on_their_way(
    res: Runtime, account_ids: list[str], horizon_ms: int
) -> tuple[set[str], set[str]]:
    """Of free, stale accounts: those whose message is most likely still waiting in the
    broker, and those whose lock a task has taken since it was read.

    On its way: published (the ``queued`` mark) less than ``horizon_ms`` ago, which is
    ``SWEEPER_STALE_AFTER`` plus the wait of the oldest message still waiting; or a delayed
    message of :func:`~payment_worker.worker.queueing.schedule` due less than that ago (or
    within a second: its ``scheduled`` marker; at its due time a retry's message may wait
    for a free slot like any other; the marker expires a few seconds after the due time, so
    a lost one is still repaired). A delayed message due later does not hold a repair back:
    the due work is not the retry's then. A backlog
    delays every message alike, so a repair would only run after the original; a lost
    message (a broker flush empties the queue) is repaired ``SWEEPER_STALE_AFTER`` after the
    oldest message still waiting was published, at the latest.

    Each account's mark is read, then its lock again, in that order in one pipeline: a task
    that started after the first lock read has deleted the mark as it took the lock, so the
    second read sees the lock held (without it, the account looked free and unmarked: a
    repair too many)."""
    if not account_ids:
        return set(), set()
    answers: list[bytes | None] = []
    now_ms = 0
    for i in range(0, len(account_ids), READ_CHUNK):
        pipe = res.redis.pipeline(transaction=False)
        for acct in account_ids[i : i + READ_CHUNK]:
            pipe.get(res.keys.queued(acct))
            pipe.hget(res.keys.scheduled(acct), "due")
            pipe.get(res.keys.lock(acct))
        if i == 0:
            pipe.time()  # the marks' clock, in the first chunk's round trip
        replies = pipe.execute(raise_on_error=False)
        if i == 0:
            clock = replies.pop()
            if isinstance(clock, Exception):
                raise clock
            now_ms = server_ms(clock)
        # (a marker of an older release is a string: its HGET's error reads as no marker)
        answers += [None if isinstance(a, Exception) else a for a in replies]
    on_its_way, taken = set(), set()
    for acct, mark, due, lock in zip(
        account_ids, answers[::3], answers[1::3], answers[2::3], strict=True
    ):
        if _recent(mark, now_ms, horizon_ms) or _recent(
            due, now_ms, horizon_ms, ahead_ms=SCHEDULED_AHEAD_MS
        ):
            on_its_way.add(acct)
        elif lock is not None:
            taken.add(acct)
    return on_its_way, taken


# a delayed message due this much ahead still counts as on its way (its task may start a
# moment early: clocks, a countdown rounded); one due later does not: the account's due
# work is other work then (a lost message), not the retry it waits for
SCHEDULED_AHEAD_MS = 1_000


def _recent(stamp: bytes | None, now_ms: int, horizon_ms: int, ahead_ms: int | None = None) -> bool:
    """A mark's or a due time's ms (server clock) less than ``horizon_ms`` ago; ahead of
    now by any amount, or with ``ahead_ms`` by at most that."""
    if stamp is None or not stamp.isdigit():
        return False
    age = now_ms - int(stamp)
    return age < horizon_ms and (ahead_ms is None or age >= -ahead_ms)
