"""Holder liveness: each worker process proves it is alive, so a dead holder's locks are
taken over in seconds instead of after the lock's TTL.

* Every process that takes account locks has a **holder id** and a **liveness key**
  (``{prefix}:alive:{holder}``, TTL ``LIVENESS_TTL_MS``) that a heartbeat thread renews
  every ``LIVENESS_INTERVAL_MS``. The value of every account lock it holds is
  ``<holder>:<token>``, so anyone reading a lock knows whose liveness to check.
* A task or the sweeper that finds an account locked by a holder whose liveness key is gone
  takes the lock at once (``lock_takeover.lua``: replace or delete it only if it still holds
  exactly the value that was judged dead).
* The holder side of the contract: a process may only trust its locks while its own
  liveness key has certainly existed without a gap since it took them. :meth:`Liveness.vouches`
  answers that with no round trip: the last successful heartbeat was sent less than
  ``LIVENESS_TTL_MS - LOCK_SAFETY_MARGIN_MS`` ago (local boottime clock), and no heartbeat
  since the lock was taken found a gap: each gap starts a new **epoch**, and a lock
  remembers the epoch it was taken in. Every beat writes a value of its own and reads the
  one it replaces (``SET … GET``); a beat that reads anything but the value of the last beat
  known to have succeeded (the key missing, or written by a beat whose reply was lost) found
  a gap. Reading that value proves the key existed from that beat until this one, however
  late this one came: only that beat ever wrote it, and an expired key never comes back.
  ``AccountLock.ensure_held`` (right before every send) checks it, so a process resumed
  after SIGSTOP stops before any send, whichever of its threads runs first. When only the
  time has run out (the heartbeat thread is late: a paused process, or one starved of the
  CPU or the GIL by a burst of its own threads), the sender waits for the next beat
  (:meth:`Liveness.await_vouch`) instead of giving its lock up at once.

* Each heartbeat also registers the holder (``{prefix}:holders``, holder id -> last beat), so
  the sweeper learns in two round trips whether any holder died (:func:`dead_holders`) and
  reads every account's lock only then.

Redis Cluster: the liveness key has its own hash tag, another slot than ``{account}``.
The takeover script therefore touches only the lock key; the liveness check is a separate,
earlier read. That is safe because a holder whose key a taker saw missing has, by the rule
above, already stopped trusting its locks (its window ended at least the margin before the
key could expire), and the exact compare in the script means the taker replaces only the
lock it judged, never a newer holder's. Writes the old holder still makes are rejected by
the Postgres fence; a request it already had in flight is resolved by lookup under the
same Idempotency-Key. docs/locks.md ("Holder liveness") has the whole argument.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import redis
from redis.exceptions import RedisError

from payment_worker import lua
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    LIVENESS_BEAT_GAP_SECONDS,
    LIVENESS_BEATS,
    LIVENESS_LAPSES,
)
from payment_worker.redis_keys import RedisKeys

log = get_logger("liveness")

# KEYS = [lock]; ARGV = [value judged dead, new value or '', ttl ms]
TAKEOVER_LUA = lua.load("lock_takeover")
# the registry on the Redis server's clock, written by each beat and pruned by the sweeper
_REGISTER_LUA = lua.load("holder_register")
_PRUNE_LUA = lua.load("holders_prune")

# "<holder>:<token>": the token is hex, so the last ':' splits the two
HOLDER_SEPARATOR = ":"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
# the sweeper reads locks in pipelines of this many commands
READ_CHUNK = 1000

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def boottime() -> float:
    """Seconds on a clock that keeps counting through a pause or a host suspend."""
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()


def make_holder_id() -> str:
    """A holder id unique to this process's life: host, pid and a random part (no ':' and
    no braces, so it neither splits a lock value nor moves a key's hash tag)."""
    host = _UNSAFE.sub("-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def lock_value(holder_id: str, token: str) -> str:
    """The value of a lock held by ``holder_id``: ``<holder>:<token>``."""
    return f"{holder_id}{HOLDER_SEPARATOR}{token}"


def holder_of(value: bytes | str | None) -> str | None:
    """The holder id of a lock value, or None (no lock, or a value without a holder: a lock
    taken without liveness, which only its TTL frees)."""
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    holder, sep, token = text.rpartition(HOLDER_SEPARATOR)
    return holder if sep and holder and token else None


class Liveness:
    """One process's liveness key and its heartbeat thread.

    Started lazily by the first lock acquisition (or eagerly by the worker's lifecycle);
    :meth:`stop` ends the thread and deletes the key, so locks left behind are taken over
    at once. Thread-safe: beats are serialised, the state is one tuple read atomically.
    ``client`` must not retry commands (the runtime gives it a renewal client): a beat sent
    twice reads its own value back, a gap as far as the rule can tell.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        *,
        ttl_ms: int,
        interval_ms: int,
        margin_ms: int,
        clock: Callable[[], float] = boottime,
        holder_id: str | None = None,
    ) -> None:
        if interval_ms <= 0 or not 0 <= margin_ms < ttl_ms:
            raise ValueError("need interval_ms > 0 and 0 <= margin_ms < ttl_ms")
        self.holder_id = holder_id or make_holder_id()
        self.key = keys.alive(self.holder_id)
        self._keys = keys
        self._registry = keys.holders()
        self.ttl_ms = ttl_ms
        self.interval = interval_ms / 1000
        # a lock is trusted while the last good beat was sent less than this long ago
        self.window = (ttl_ms - margin_ms) / 1000
        self.margin_ms = margin_ms
        # a gap was found and the new holder id is not written yet (see _rotate)
        self._rotating = False
        self._client = client
        self._clock = clock
        # (epoch, clock reading before the last successful beat was sent, the value that
        # beat wrote); epoch 0: never beaten, -1: stopped. One tuple, so a reader never sees
        # half an update.
        self._state: tuple[int, float, bytes] = (0, float("-inf"), b"")
        self._beats = 0
        self._beat_mutex = threading.Lock()
        # senders waiting for the next beat (await_vouch): each one's own held lock, released
        # by the beat. No lock shared with them: a sender holding one while it waits for the
        # GIL among a thousand threads would hold the heartbeat up behind it
        self._waiters: deque[threading.Lock] = deque()
        self._start_mutex = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- heartbeat ------------------------------------------------------------------------

    def beat(self, *, unless_fresh: bool = False) -> bool:
        """Renew the key once; True on success. A gap since the last success (the key held
        anything but the value that success wrote: missing, or another beat's) starts a
        new epoch: the locks taken before it are no longer vouched for. ``unless_fresh``:
        nothing to do (True) when a beat made while this one waited its turn vouches now."""
        with self._beat_mutex:
            if self._stopping.is_set():
                return False
            if unless_fresh and self.current_epoch() is not None:
                return True
            sent = self._clock()
            # a value no other beat writes: reading it back proves the key never lapsed
            self._beats += 1
            value = f"{os.getpid()}-{self._beats}".encode()
            # one round trip: the key, and the holder's entry in the registry, so a holder
            # vouched for (the only kind that takes locks) is always registered; the sweeper
            # reads the locks of recently written accounts only while a registered one is dead
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self.key, value, px=self.ttl_ms, get=True)
            # (EVAL, not EVALSHA: a pipeline's script would cost a SCRIPT EXISTS per beat)
            pipe.eval(_REGISTER_LUA, 1, self._registry, self.holder_id)
            try:
                old = pipe.execute()[0]
                if isinstance(old, str):  # a client that decodes replies
                    old = old.encode()
            except RedisError as exc:
                LIVENESS_BEATS.labels("error").inc()
                log.warning("liveness_beat_failed", holder=self.holder_id, error=str(exc))
                return False
            replied = self._clock()
            epoch, last, last_value = self._state
            if epoch > 0 and last != float("-inf"):  # (-inf: a gap's beat not yet written)
                LIVENESS_BEAT_GAP_SECONDS.observe(replied - last)
            if epoch <= 0 or old != last_value:
                if epoch > 0:
                    LIVENESS_LAPSES.inc()
                    log.warning(
                        "liveness_lapsed",
                        holder=self.holder_id,
                        key_was_missing=old is None,
                        since_last_beat_s=round(replied - last, 3),
                    )
                    # nothing taken before this beat is trusted from now, whatever the new
                    # holder id's write below does (vouched for once it is written)
                    self._state = (epoch + 1, float("-inf"), value)
                    self._wake_waiters()
                    self._rotating = True
                epoch = max(epoch, 0) + 1
            elif not self._rotating and replied - last >= self.window:
                # late, but the key held the last beat's value: it never lapsed, the locks
                # stay ours (senders that checked meanwhile waited for this beat)
                log.warning(
                    "liveness_beat_late",
                    holder=self.holder_id,
                    since_last_beat_s=round(replied - last, 3),
                )
            if self._rotating:
                if not self._rotate(value):
                    LIVENESS_BEATS.labels("error").inc()
                    return False  # not vouched for: the next beat tries again
                self._rotating = False
            self._state = (epoch, sent, value)
            self._wake_waiters()
            LIVENESS_BEATS.labels("ok").inc()
            return True

    def _rotate(self, value: bytes) -> bool:
        """After a gap: go on under a new holder id, its key written with ``value``, and the
        old id's key left to expire after the margin (one round trip; False, nothing
        changed, when it fails). The margin, as for any holder: this process stopped
        trusting its locks (the gap's new epoch) at least that long before a taker finds
        the old id dead.

        Locks that name the old id are not trusted any more (a new epoch), but a Redis
        restored from a snapshot, or a replica promoted by a failover, can bring back locks
        this process had released since, naming it; alive under the same id, it would keep
        every taker off them for their whole TTL. Under a new id, the old one is dead after
        the margin: they are taken over then (and the sweeper, which still finds the old id
        in the registry, reads the locks)."""
        old_id, old_key = self.holder_id, self.key
        new_id = make_holder_id()
        new_key = self._keys.alive(new_id)
        pipe = self._client.pipeline(transaction=False)
        pipe.set(new_key, value, px=self.ttl_ms)
        pipe.eval(_REGISTER_LUA, 1, self._registry, new_id)
        pipe.pexpire(old_key, max(1, self.margin_ms))
        try:
            pipe.execute()
        except RedisError as exc:
            log.warning("liveness_rotate_failed", holder=old_id, error=str(exc))
            return False
        # the key before the id: a taker that reads the new id finds its key written
        self.key = new_key
        self.holder_id = new_id
        log.warning("liveness_new_holder_id", old_holder=old_id, holder=new_id)
        return True

    def _wake_waiters(self) -> None:
        """Release every sender waiting for a beat (after the state they read changed)."""
        while True:
            try:
                waiter = self._waiters.popleft()
            except IndexError:
                return
            waiter.release()  # held since it was queued; each is popped once

    def _run(self) -> None:
        delay = self.interval
        while not self._stopping.wait(delay):
            try:
                ok = self.beat()
            except Exception:
                # a bug must not end the heartbeat silently; the window protects the locks
                log.exception("liveness_tick_failed", holder=self.holder_id)
                ok = False
            # after a failure try again soon: the window is short
            delay = self.interval if ok else min(self.interval, 0.1)

    def start(self) -> bool:
        """Beat once now and start the heartbeat thread (no-op when running or stopped).
        Returns whether the process is vouched for now."""
        with self._start_mutex:
            if self._thread is None and not self._stopping.is_set():
                self.beat()
                self._thread = threading.Thread(target=self._run, name="pw-liveness", daemon=True)
                self._thread.start()
                log.info("liveness_started", holder=self.holder_id, key=self.key)
        return self.current_epoch() is not None

    def stop(self, *, forget: bool = True, timeout: float = 2.0) -> None:
        """Stop beating; with ``forget`` delete the key, so any lock this process still
        holds is taken over at once. Nothing is vouched for afterwards."""
        self._stopping.set()
        with self._beat_mutex:
            self._state = (-1, float("-inf"), b"")
            self._wake_waiters()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if forget and thread is not None:
            try:
                # out of the registry as well: a lock still held is then found by staleness
                # (SWEEPER_STALE_AFTER), not by a sweeper reading every lock for a while
                pipe = self._client.pipeline(transaction=False)
                pipe.delete(self.key)
                pipe.zrem(self._registry, self.holder_id)
                pipe.execute()
            except RedisError as exc:
                log.warning("liveness_forget_failed", holder=self.holder_id, error=str(exc))

    @property
    def running(self) -> bool:
        """Whether the heartbeat thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # --- what the locks ask -----------------------------------------------------------------

    def current_epoch(self) -> int | None:
        """The epoch if the process is vouched for right now, else None. No round trip."""
        epoch, last, _ = self._state
        if epoch > 0 and self._clock() < last + self.window:
            return epoch
        return None

    def epoch_for_acquire(self) -> int | None:
        """The epoch to record in a lock about to be taken: starts the heartbeat on first
        use, beats at once when the last beat is too old. None: the process cannot prove it
        is alive (Redis unreachable, stopped); take no lock then."""
        if self._thread is None and not self._stopping.is_set():
            self.start()
        epoch = self.current_epoch()
        # one beat for all the takers that found it stale at once, not one each in a row
        if epoch is None and not self._stopping.is_set() and self.beat(unless_fresh=True):
            epoch = self.current_epoch()
        return epoch

    def vouches(self, epoch: int) -> bool:
        """Whether a lock taken in ``epoch`` may still be trusted: the key has existed
        without a gap since, and the last good beat is recent. No round trip."""
        return self.current_epoch() == epoch

    def await_vouch(self, epoch: int, timeout: float) -> bool:
        """:meth:`vouches`, waiting up to ``timeout`` seconds for the heartbeat when only
        the time has run out: no gap is known in ``epoch``, but the last good beat is older
        than the window. A late beat that finds the key unbroken vouches again; one that
        finds a gap, a stop or the timeout ends the wait with False. The waiting threads
        sleep without the GIL, so a burst that starved the heartbeat thread also makes way
        for it. No round trip of its own."""
        end = time.monotonic() + timeout
        while True:
            # queued before the state is read: a beat that publishes after the read wakes it
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
            if self.current_epoch() == epoch:
                return True
            left = end - time.monotonic()
            if self._state[0] != epoch or self._stopping.is_set() or left <= 0:
                return False
            waiter.acquire(timeout=left)


# --- what a taker does (a task on contention, the sweeper) -------------------------------------


def alive_holders(client: redis.Redis, keys: RedisKeys, holders: Sequence[str]) -> set[str]:
    """The holders among ``holders`` whose liveness key exists (one pipelined round trip)."""
    if not holders:
        return set()
    pipe = client.pipeline(transaction=False)
    for holder in holders:
        pipe.exists(keys.alive(holder))
    return {h for h, n in zip(holders, pipe.execute(), strict=True) if n}


def dead_holders(client: redis.Redis, keys: RedisKeys, keep_ms: int) -> set[str]:
    """Registered holders whose liveness key is gone: each died or paused (its locks may
    still be held). Entries older than ``keep_ms`` are dropped first: a holder silent that
    long holds no lock any more (locks expire after their TTL without renewals), and a
    paused one registers again with its next beat. Both on the Redis server's clock, which
    every beat scores its entry by. Two round trips."""
    members = client.register_script(_PRUNE_LUA)(keys=[keys.holders()], args=[keep_ms])
    registered = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
    return set(registered) - alive_holders(client, keys, registered)


def read_locks(
    client: redis.Redis, keys: RedisKeys, account_ids: Sequence[str]
) -> list[bytes | None]:
    """The lock values of ``account_ids`` (None: free), in pipelines of ``READ_CHUNK`` GETs
    (one GET per key, so it works across Redis Cluster slots)."""
    out: list[bytes | None] = []
    for i in range(0, len(account_ids), READ_CHUNK):
        pipe = client.pipeline(transaction=False)
        for acct in account_ids[i : i + READ_CHUNK]:
            pipe.get(keys.lock(acct))
        out += pipe.execute()
    return out


def take_over(
    client: redis.Redis,
    lock_key: str,
    dead_value: bytes | str,
    new_value: str = "",
    ttl_ms: int = 0,
) -> bool:
    """Replace (``new_value``) or delete (``''``) a lock whose holder was found dead, only if
    it still holds exactly ``dead_value``. True when done."""
    old = dead_value.decode() if isinstance(dead_value, bytes) else dead_value
    script = client.register_script(TAKEOVER_LUA)
    return bool(script(keys=[lock_key], args=[old, new_value, max(ttl_ms, 1)]) == 1)
