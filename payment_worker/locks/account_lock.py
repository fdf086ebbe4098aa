"""The account lock: one worker per account at a time, fenced in Postgres.

* Acquire: ``SET {prefix}:lock:{account} <random token> NX PX <ttl>``; the hash tag
  ``{account}`` puts every key of one account in one Redis Cluster slot.
* Release and renew are owner-checked Lua scripts: a lock that is no longer ours is
  never deleted or extended.
* The process's renewer (one thread for every held lock, :mod:`.watchdog`) renews each
  lock at TTL/3, all due locks in one round trip. A renewal that finds the key gone or owned by
  another token, or a Redis that stays unreachable until the local deadline (last
  successful renewal + TTL - safety margin), marks the lock lost; :meth:`ensure_held`
  raises :class:`LockLost` before any side effect.
* A holder reports progress (:meth:`AccountLock.progress`); one that reported none for
  ``max_stall`` seconds is blocked somewhere, and the renewer stops renewing its lock
  (lost, ``stalled``), so the lock expires and another worker takes the account over
  behind the fence.
* With a process :class:`~payment_worker.locks.liveness.Liveness`, the lock's value is
  ``<holder>:<token>``; a lock whose holder's liveness key is gone is taken over at once
  (``lock_takeover.lua``), and :meth:`ensure_held` also fails once this process's own
  liveness may have lapsed since the lock was taken (reason ``liveness``).
* Every acquisition takes a new fencing token from Postgres (one round trip); writes
  guarded by :mod:`payment_worker.db.fences` reject an older holder.
* A blocking acquire waits in a FIFO queue (:mod:`.wait_queue`): release hands the lock
  straight to the oldest live waiter and wakes it with a push to its own list (BLPOP), so
  nobody polls and nobody starves.

docs/locks.md describes the keys, scripts and rules; the key names are spelled in
:mod:`payment_worker.redis_keys`, the scripts in ``payment_worker/lua/lock_*.lua``.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy
from redis.exceptions import RedisError

from payment_worker import lua
from payment_worker.db.fences import issue_fence_token
from payment_worker.errors import LockLost, LockNotAcquired
from payment_worker.locks.arrival import Arrival, EndRider, Rider
from payment_worker.locks.giveback import GiveBack
from payment_worker.locks.liveness import (
    TAKEOVER_LUA,
    Liveness,
    alive_holders,
    holder_of,
    lock_value,
)
from payment_worker.locks.wait_queue import WaitQueue
from payment_worker.locks.watchdog import Lease, Renewer, StallRule, renewal_client
from payment_worker.locks.watchdog import clock as _clock
from payment_worker.ops.logging import get_logger
from payment_worker.ops.metrics import (
    LOCK_ACQUIRE_SECONDS,
    LOCK_CONTENTION,
    LOCK_LOST,
    LOCK_RELEASE_NOT_OWNER,
    LOCK_RENEWALS,
    LOCK_TAKEOVERS,
)
from payment_worker.redis_keys import RedisKeys
from payment_worker.redis_pool import UNREACHABLE

log = get_logger("locks")

# the default of REDIS_KEY_PREFIX, for callers that pass no prefix (tools, tests)
DEFAULT_KEY_PREFIX = "pw"

# KEYS = [lock, waiter queue, waiter leases] (+ an arrival mark); header in the file
_RELEASE_LUA = lua.load("lock_release")
_LEAVE_LUA = lua.load("lock_leave")
_END_LUA = lua.load("account_end")


def lock_key(account_id: str, key_prefix: str | None = None) -> str:
    """The Redis key of an account's lock: ``{prefix}:lock:{account_id}`` with a hash tag."""
    return _keys(key_prefix).lock(account_id)


def _keys(key_prefix: str | None) -> RedisKeys:
    """The key names under ``key_prefix``, or under the default prefix when None."""
    return RedisKeys(key_prefix if key_prefix is not None else DEFAULT_KEY_PREFIX)


def lock_is_held(redis: redis.Redis, account_id: str, key_prefix: str | None = None) -> bool:
    """Whether anyone holds the account's lock right now (for the sweeper)."""
    return bool(redis.exists(lock_key(account_id, key_prefix)))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class AccountLock:
    """The lock of one account, with renewal, a lost-lock signal and fencing.

    Use as a context manager (blocking up to ``wait_timeout``, raising
    :class:`LockNotAcquired`) or call :meth:`acquire` / :meth:`release`. Between them,
    call :meth:`ensure_held` before every side effect and carry :attr:`fence_token` in
    every state write, and :meth:`progress` whenever work gets done when ``max_stall`` is
    set. Redis clients should have a ``socket_timeout`` (a hung Redis then fails renewals
    instead of blocking the renewer); the local deadline protects the holder either way.

    ``renewer`` is the process's :class:`Renewer` (the Runtime's: one thread renews every
    held lock); a lock built without one gets its own, whose thread ends with each release.
    ``giveback`` is the process's :class:`~payment_worker.locks.giveback.GiveBack`: a release
    (or a take) whose round trip failed is retried there, owner-checked, until Redis answers
    or the TTL runs out; without one the TTL alone frees such a lock.
    """

    def __init__(
        self,
        redis: redis.Redis,
        account_id: str,
        *,
        engine: sqlalchemy.Engine,
        ttl_ms: int = 30_000,
        safety_margin_ms: int = 1_000,
        key_prefix: str | None = None,
        wait_timeout: float = 0.0,
        renewal_redis: redis.Redis | None = None,
        on_lost: Callable[[str], None] | None = None,
        max_stall: float | None = None,
        liveness: Liveness | None = None,
        renewer: Renewer | None = None,
        giveback: GiveBack | None = None,
    ) -> None:
        self.account_id = account_id
        self.ttl_ms = ttl_ms
        self.safety_margin_ms = safety_margin_ms
        self.wait_timeout = wait_timeout
        if self.ttl_ms <= 0 or not 0 <= self.safety_margin_ms < self.ttl_ms:
            raise ValueError("need ttl_ms > 0 and 0 <= safety_margin_ms < ttl_ms")
        self._keys = _keys(key_prefix)
        self.key = self._keys.lock(account_id)
        self.fence_token: int | None = None
        self.lost_reason: str | None = None
        # after release(arrival): whether its mark was there (None: not read)
        self.marked: bool | None = None
        self._redis = redis
        self._engine = engine
        self._on_lost = on_lost
        # the release script's KEYS: the lock, its waiter queue, the waiters' leases
        self._queue_keys = [
            self.key,
            self._keys.lock_queue(account_id),
            self._keys.lock_waiters(account_id),
        ]
        self._state = threading.Lock()
        self._token: str | None = None
        self._deadline = 0.0
        self._lease: Lease | None = None
        # LOCK_MAX_STALL_SECONDS: how long the holder may go without reporting progress
        self._stall = StallRule(max_stall, _clock)
        # renewals go through a no-retry client with a short socket timeout; the Runtime
        # shares one renewer (client and thread) per process, a lock built without one makes
        # its own
        if renewer is None:
            client = renewal_redis if renewal_redis is not None else renewal_client(redis, ttl_ms)
            renewer = Renewer(client, linger=0.0, name=f"lock-renewer-{account_id}")
        self._renewer = renewer
        self._giveback = giveback
        self._release = redis.register_script(_RELEASE_LUA)
        self._leave = redis.register_script(_LEAVE_LUA)
        self._end = redis.register_script(_END_LUA)
        # the process's heartbeat (locks/liveness.py); None: a plain token, freed by TTL only
        self._liveness = liveness
        self._epoch = 0
        self._takeover = redis.register_script(TAKEOVER_LUA)

    # --- acquire ----------------------------------------------------------------------

    def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        arrival: Arrival | None = None,
        fence: bool = True,
        rider: Rider | None = None,
    ) -> bool:
        """Take the lock; True on success, then :attr:`fence_token` is set (with ``fence``).

        Non-blocking (the default, or ``timeout <= 0``): one ``SET NX PX``. Blocking:
        join the FIFO queue and wait up to ``timeout`` seconds (None: forever) for the
        holder's release to hand the lock over. On success one Postgres round trip
        takes the fencing token and the lock joins the renewer; if that step fails the Redis
        lock is released and the error re-raised.

        ``fence=False``: no token is taken here; the holder's first database statement must
        issue it (``db.work.fence_and_claim``) before any other write, and hand it to
        :meth:`adopt_fence`. The drain does so: one round trip per account fewer.

        ``arrival``: the work this attempt brings (:mod:`.arrival`): its mark is left when the
        lock is not taken, and the marks are cleared when it is, in the ``SET NX``'s round trip.
        ``rider`` (with ``arrival`` only): read what it asks for in that round trip too, when
        the lock is taken there (:mod:`.arrival`); a lock taken another way (a dead holder's)
        leaves the rider untouched.
        """
        with self._state:
            if self._token is not None:
                raise RuntimeError(f"lock {self.key} is already held by this object")
        started = _clock()
        token = secrets.token_hex(16)
        epoch = 0
        if self._liveness is not None:
            # the process must be provably alive before its holder id goes into a lock,
            # or a taker could find the lock's holder dead at once
            found = self._liveness.epoch_for_acquire()
            if found is None:
                LOCK_ACQUIRE_SECONDS.labels("error").observe(_clock() - started)
                log.warning("lock_not_taken_liveness_failing", account_id=self.account_id)
                if arrival is not None:
                    arrival.leave_mark(self._redis)
                return False
            epoch = found
            token = lock_value(self._liveness.holder_id, token)
        try:
            granted_at = self._take(token, blocking, timeout, started, arrival, rider)
        except RedisError as exc:
            LOCK_ACQUIRE_SECONDS.labels("error").observe(_clock() - started)
            if isinstance(exc, UNREACHABLE):
                # the take may have run and only its reply been lost: a lock nobody knows
                # it holds would keep the account for the whole TTL
                self._give_back_later(token)
            raise
        if granted_at is None:
            result = "timeout" if blocking and (timeout is None or timeout > 0) else "busy"
            LOCK_ACQUIRE_SECONDS.labels(result).observe(_clock() - started)
            return False
        with self._state:
            self._token = token
            self._epoch = epoch
            self.lost_reason = None
            self.fence_token = None
            self._deadline = granted_at + (self.ttl_ms - self.safety_margin_ms) / 1000
            self._stall.touch()
        issued: int | None = None
        if fence:
            try:
                issued = issue_fence_token(self._engine, self.account_id)
            except BaseException:
                LOCK_ACQUIRE_SECONDS.labels("error").observe(_clock() - started)
                self.release()
                raise
        with self._state:
            self.fence_token = issued
            self._start_renewal(token)
        LOCK_ACQUIRE_SECONDS.labels("acquired").observe(_clock() - started)
        log.debug("lock_acquired", account_id=self.account_id, fence_token=issued)
        return True

    def adopt_fence(self, token: int) -> None:
        """The fencing token the holder's first statement issued (``acquire(fence=False)``)."""
        with self._state:
            self.fence_token = token

    def _take(
        self,
        token: str,
        blocking: bool,
        timeout: float | None,
        started: float,
        arrival: Arrival | None = None,
        rider: Rider | None = None,
    ) -> float | None:
        """Get the Redis lock; the clock reading taken before the granting command, or None."""
        sent = _clock()
        if arrival is not None:
            if arrival.take(self._redis, self.key, token, self.ttl_ms, rider):
                return sent
        elif self._redis.set(self.key, token, nx=True, px=self.ttl_ms):
            return sent
        LOCK_CONTENTION.inc()
        granted = self._take_over(token, sent) if self._liveness is not None else None
        if granted is None and blocking and (timeout is None or timeout > 0):
            until = None if timeout is None else started + timeout
            queue = WaitQueue(
                self._redis,
                self._keys,
                self.account_id,
                self._queue_keys,
                self.ttl_ms,
                self._leave_queue,
                self._take_over if self._liveness is not None else None,
            )
            granted = queue.wait(token, until)
        if granted is not None and arrival is not None:
            arrival.clear(self._redis)  # taken from a dead holder, or handed over
        return granted

    def _take_over(self, token: str, attempted: float) -> float | None:
        """The lock is held: if its holder process is dead (liveness key gone), take it; if
        it holds ``token``, it is ours already (a retried take; ``attempted``: the clock
        reading before the take was first sent).

        Two reads (the lock, the holder's liveness key: another Redis Cluster slot) and, for
        a dead holder, the takeover script, which replaces the lock only if it still holds
        the value judged dead. Returns the clock reading taken before the granting command.
        """
        assert self._liveness is not None
        current = self._redis.get(self.key)
        if current is not None and _text(current) == token:
            # our own take ran and its reply was lost; the client's retry found the lock
            # taken (a value is unique to one acquisition): it is ours, since before the
            # first try left
            return attempted
        holder = holder_of(current)
        if current is None or holder is None or holder == self._liveness.holder_id:
            return None  # free again (its releaser sees our mark), no holder id, or us
        if alive_holders(self._redis, self._keys, [holder]):
            return None
        sent = _clock()
        old = current.decode() if isinstance(current, bytes) else str(current)
        if self._takeover(keys=[self.key], args=[old, token, self.ttl_ms]) != 1:
            return None
        LOCK_TAKEOVERS.labels("task").inc()
        log.info("lock_taken_over", account_id=self.account_id, dead_holder=holder)
        return sent

    # --- holding ----------------------------------------------------------------------

    def _start_renewal(self, token: str) -> None:
        """With ``_state`` held: register the lock with the renewer (first renewal at TTL/3)."""
        lease = Lease(
            self.key,
            token,
            self.ttl_ms,
            check=lambda: self._before_renewal(token),
            renewed=lambda answer, sent: self._renewed(token, answer, sent),
            failed=lambda error: self._renew_failed(token, error),
        )
        self._lease = lease
        self._renewer.add(lease)

    def _before_renewal(self, token: str) -> bool:
        """Before each renewal: False when the lock must not be renewed (released, lost, or
        its holder stalled, which marks it lost here)."""
        if self._token != token or self.lost_reason is not None:
            return False  # released, or lost: once lost, never renewed again
        silent = self._stall.stalled_for()
        if silent is not None:
            # no renewal: the key expires within one TTL and the account is free for a holder
            # that works; this one's writes are fenced out and ensure_held() stops its sends
            self._mark_lost(token, "stalled", silent_s=round(silent, 3))
            return False
        return True

    def _renewed(self, token: str, answer: int, sent: float) -> bool:
        """The renewal script answered (1 renewed, 0 gone, -1 stolen); False: stop renewing."""
        if answer == 1:
            with self._state:
                if self._token != token or self.lost_reason is not None:
                    return False  # released or lost while the renewal was in flight
                self._deadline = sent + (self.ttl_ms - self.safety_margin_ms) / 1000
            LOCK_RENEWALS.labels("ok").inc()
            return True
        if self._token != token:
            return False  # released meanwhile: the answer is about the next owner's key
        LOCK_RENEWALS.labels("lost").inc()
        self._mark_lost(token, "expired" if answer == 0 else "stolen")
        return False

    def _renew_failed(self, token: str, error: Exception) -> float | None:
        """A renewal round trip failed: the delay to the next try, or None once the local
        deadline has passed (lost, ``unreachable``). The renewer logs the failure once per
        batch."""
        if self._token != token or self.lost_reason is not None:
            return None
        LOCK_RENEWALS.labels("error").inc()
        left = self._deadline - _clock()
        if left <= 0:
            self._mark_lost(token, "unreachable", error=str(error))
            return None
        # try again soon, but no later than the next regular tick
        return max(0.01, min(self.ttl_ms / 3000, left / 2))

    def _mark_lost(self, token: str, reason: str, **detail: object) -> None:
        with self._state:
            if self._token != token or self.lost_reason is not None:
                return
            self.lost_reason = reason
            lease = self._lease
        if lease is not None:
            self._renewer.remove(lease)
        LOCK_LOST.labels(reason).inc()
        log.warning(
            "lock_lost",
            account_id=self.account_id,
            reason=reason,
            fence_token=self.fence_token,
            **detail,
        )
        if self._on_lost is not None:
            try:
                self._on_lost(reason)
            except Exception:
                log.exception("lock_on_lost_failed", account_id=self.account_id)

    def progress(self) -> None:
        """The holder got something done: its lock is renewed for another ``max_stall``.
        No network round trip; safe to call at any time (a no-op when not held)."""
        self._stall.touch()

    def ensure_held(self, *, wait: bool = True) -> None:
        """Raise :class:`LockLost` unless the lock is still ours. No network round trip.

        Reads what the renewer found and checks the local deadline, so a holder that
        was paused past its TTL stops even before the renewer runs again. When the
        process's heartbeat is only late (no gap known), waits for it (up to
        ``LIVENESS_TTL_MS``; ``wait=False``: not at all) before deciding.
        """
        token = self._token
        if token is None:
            raise LockLost(f"lock {self.key} is not held")
        if self.lost_reason is None and _clock() >= self._deadline:
            self._mark_lost(token, "deadline")
        liveness = self._liveness
        if self.lost_reason is None and liveness is not None and not liveness.vouches(self._epoch):
            # a starved heartbeat thread (a burst of this process's own threads) is late
            # without any gap: its next beat tells whether the key lapsed
            if not (wait and liveness.await_vouch(self._epoch, liveness.ttl_ms / 1000)):
                # this process's liveness key may have lapsed since the lock was taken
                # (paused, Redis unreachable or flushed): a taker may own the account now
                self._mark_lost(token, "liveness")
            elif _clock() >= self._deadline:  # the wait ran past the lock's own deadline
                self._mark_lost(token, "deadline")
        reason = self.lost_reason
        if reason is not None:
            raise LockLost(f"lock {self.key} lost ({reason})")

    @property
    def lost(self) -> bool:
        """True when the lock was acquired and is no longer safely ours."""
        try:
            self.ensure_held(wait=False)
        except LockLost:
            return self._token is not None
        return False

    @property
    def held(self) -> bool:
        """True while acquired, not released and not lost."""
        return self._token is not None and not self.lost

    # --- release ----------------------------------------------------------------------

    def release(self, arrival: Arrival | None = None, rider: EndRider | None = None) -> bool:
        """Give the lock back: owner-checked, stops its renewal at once, wakes one waiter.

        Returns True when the lock was ours and is now free or handed to the oldest
        waiter; False (logged and counted) when it was no longer ours, and False when
        Redis could not be reached (the give-back thread then retries the release until
        Redis answers or the TTL frees the lock). With ``arrival``, its mark is
        read in the same round trip: :attr:`marked`. With ``rider`` (only with ``arrival``:
        a ValueError otherwise), what it gives back goes in that round trip too, before the
        release and whether or not the lock was still ours (``lua/account_end.lua``); lost
        with the round trip when Redis cannot be reached (the holder's lease then only runs
        out).
        """
        if rider is not None and arrival is None:
            raise ValueError("an end rider goes with the arrival whose mark the release reads")
        self.marked = None
        with self._state:
            token = self._token
            self._token = None
            lease, self._lease = self._lease, None
        if lease is not None:
            self._renewer.remove(lease)
        if token is None:
            return False
        keys = self._queue_keys
        try:
            if rider is not None and arrival is not None:  # (both, checked above)
                reply = self._end(
                    keys=[*keys, arrival.mark, *rider.keys],
                    args=[token, self.ttl_ms, *rider.args],
                )
                released = reply[0]
                self.marked = int(reply[1]) == 1
            else:
                extra = [arrival.mark] if arrival is not None else []
                released = self._release(keys=keys + extra, args=[token, self.ttl_ms])
                if extra:
                    self.marked = int(released[-1]) == 1
        except RedisError as exc:
            log.warning("lock_release_failed", account_id=self.account_id, error=str(exc))
            if isinstance(exc, UNREACHABLE):
                self._give_back_later(token)
            return False
        code = self._settle_release(released)
        if code <= 0:
            LOCK_RELEASE_NOT_OWNER.inc()
            log.warning(
                "lock_release_not_owner",
                account_id=self.account_id,
                state="expired" if code == 0 else "other_owner",
                lost_reason=self.lost_reason,
            )
            return False
        log.debug("lock_released", account_id=self.account_id, handed_over=code == 2)
        return True

    def _settle_release(self, released: Any) -> int:
        """The release script's code; a lock handed to a waiter wakes it."""
        code = int(released[0])
        if code == 2:
            self._wake(_text(released[1]))
        return code

    def _leave_queue(self, token: str, cause: BaseException) -> None:
        """A waiter that gives up on ``cause``: leave the queue and give back a lock handed
        to it, in one script (the next waiter woken); when that fails too, the give-back
        thread retries it (acquire hands it over itself when ``cause`` is Redis out of reach).
        Never raises: ``cause`` is what the caller sees."""
        try:
            self._settle_release(self._leave(keys=self._queue_keys, args=[token, self.ttl_ms]))
        except RedisError:
            if not isinstance(cause, UNREACHABLE):
                self._give_back_later(token)

    def _wake(self, waiter: str) -> None:
        """Wake the waiter the lock was handed to (a lost wake-up costs it one fallback check
        of the lock, at most a block's wait: locks/wait_queue.py)."""
        wake = self._keys.lock_wake(self.account_id, waiter)
        try:
            # one MULTI: a wake list is never left without its expiry
            pipe = self._redis.pipeline(transaction=True)
            pipe.lpush(wake, 1)
            pipe.pexpire(wake, self.ttl_ms)
            pipe.execute()
        except RedisError as exc:
            log.info("lock_wake_failed", account_id=self.account_id, error=str(exc))

    def _give_back_later(self, token: str) -> None:
        """Hand the release of ``token`` to the process's give-back thread (the round trip
        that should have released it, or taken it, failed). It leaves the waiter queue too
        (``lock_leave.lua``): a take that failed while waiting may have left its place, and a
        release handing the lock to it later would hold the account for the whole TTL."""
        if self._giveback is None:
            return  # the TTL frees it
        keys = self._queue_keys

        def attempt() -> int:
            return self._settle_release(self._leave(keys=keys, args=[token, self.ttl_ms]))

        self._giveback.add(self.account_id, attempt, self.ttl_ms / 1000)

    def __enter__(self) -> AccountLock:
        timeout = self.wait_timeout
        if not self.acquire(blocking=timeout > 0, timeout=timeout):
            raise LockNotAcquired(f"account {self.account_id} is locked by another worker")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
