"""Every Redis key the service reads or writes, spelled in one place.

The strings are a wire format: running workers of another version, dashboards and ops'
runbooks use them, so a change here is a migration, not a refactor
(``tests/unit/test_redis_keys.py`` pins each one). ``prefix`` is ``REDIS_KEY_PREFIX``
(default ``pw``). Per-account keys carry the Redis Cluster hash tag ``{account}``, so all
keys of one account live in one slot and a Lua script may name several of them in ``KEYS``.

Each entry: key (type, TTL): what it holds; who writes it.

``{prefix}:lock:{acct}`` (string, ``LOCK_TTL_MS``, renewed every TTL/3)
    The account lock; value: the holder's random token. AccountLock (``SET NX``; the
    release and wait scripts hand it straight to the oldest live waiter).
``{prefix}:lock:{acct}:queue`` (list, at least the longest waiter lease)
    Blocking waiters' tokens, FIFO. AccountLock's wait script; release and cancel pop.
``{prefix}:lock:{acct}:waiters`` (hash, as the queue)
    Waiter token -> lease expiry in Redis server ms. AccountLock's wait script.
``{prefix}:lock:{acct}:wake:{waiter token}`` (list, ``LOCK_TTL_MS``)
    One waiter's wake-up signal (BLPOP). AccountLock.release after a hand-off.
``{prefix}:token:{acct}`` (hash, the access token's remaining lifetime)
    ``token``, ``lead_ms``: the account's shared gateway token. TokenManager's store script.
``{prefix}:token-lock:{acct}`` (string, gateway connect + read timeout + 1 s)
    The token refresh lock; value: a random owner. TokenManager.
``{prefix}:pace:{acct}`` (hash, the last leased slot + 1 s; a 429's cooldown + 60 s)
    ``tat``, ``until``: the account's first free request slot and cooldown. Pacer's scripts.
``{prefix}:waiting:{acct}`` (string, 4 x ``LOCK_TTL_MS``)
    "Work waiting" left by a task that found the lock busy; value: a batch id. The drain
    loop: set, or deleted with the two marks below when the lock is taken, by the lock
    attempt's own script (``lock_take.lua``, the drain's ``account_start.lua``); the holder
    checks it after releasing.
``{prefix}:scheduled:{acct}`` (hash, until its due time + 5 s)
    The account's one delayed message is on its way: ``due`` (ms, Redis server clock),
    ``batch`` (the batch id it carries), ``call`` (the claim's own random value: its retry
    after a lost reply is answered as the claim was). The drain loop
    (``schedule_claim.lua``: an earlier message replaces a later one), cleared by that
    message's task (``schedule_clear.lua``).
    Versions before due times wrote a string (the batch id, countdown + 5 s); the scripts
    read it as due 5 s before it expires.
``{prefix}:swept:{acct}`` (string, ``SWEEPER_RESEND_AFTER``)
    A repair message was sent for the account and its task has not started yet; value: a
    batch id. The sweeper; deleted by the drain loop when a holder takes the account.
``{prefix}:queued:{acct}`` (string, ``VISIBILITY_TIMEOUT``)
    A message for the account was published at this time (ms since the epoch, on the Redis
    server's clock: ``queued_mark.lua`` reads ``TIME``) and no holder has taken the account
    since. Set before each publish that names the account (the producer, a hand-off, a
    repair, a replay), deleted by the drain loop when a holder takes the account; the
    sweeper reads it to tell a message still waiting behind a backlog from a lost one.
``{prefix}:alive:{holder}`` (string, ``LIVENESS_TTL_MS``, renewed every ``LIVENESS_INTERVAL_MS``)
    One worker process is alive; value: ``<pid>-<beat number>``. The process's heartbeat thread
    (:mod:`payment_worker.locks.liveness`). ``holder`` is the process's holder id, which
    prefixes the value of every account lock it holds (``<holder>:<token>``). Its own hash
    tag: it is in another slot than any account's keys.
``{prefix}:sweeper`` (string, max(2 x ``SWEEPER_INTERVAL``, 1 s))
    The sweeper's own redis-py ``Lock``: two passes never overlap. The sweeper.
``{prefix}:sweeper:tick`` (string, 0.8 x ``SWEEPER_INTERVAL``)
    This interval's pass is taken; value: the pid that took it. The sweeper threads of the
    worker processes (and beat's fallback task): ``SET NX``, so the fleet sweeps about once
    per interval however many processes tick.
``{prefix}:sweeper:waited`` (string, ``SWEEPER_STALE_AFTER``)
    When the oldest message waiting in the ``payments`` queue at the last pass that found
    one was published (ms since the epoch, the ``pw_enqueued_ms`` header). The sweeper, each
    pass that finds a message waiting; it expires after the stale period: a message taken
    by a worker since that pass is on its way until then, even once the queue is empty.
``{prefix}:submit:{batch_id}`` (string, ``DEDUP_WINDOW_SECONDS``)
    The producer's dedup window; value: the batch's content fingerprint. The producer.
``{prefix}:submissions`` (hash, no TTL)
    Submissions counted by result: ``accepted``, ``duplicate``, ``rejected`` -> count
    (``HINCRBY``). The producer (any process that submits); ``payment-worker exporter``
    serves them as ``payment_worker_submissions_total``.

``{acct}`` above is the literal hash tag: the account id between braces. The sweeper's keys
and the dedup window are not per account and have no hash tag.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """The key names under one prefix; cheap to build, holds no connection."""

    prefix: str = "pw"

    def _account(self, kind: str, account_id: str) -> str:
        # the braces are a Redis Cluster hash tag: every key of an account in one slot
        return f"{self.prefix}:{kind}:{{{account_id}}}"

    # --- the account lock (payment_worker.locks.account_lock) ---------------------------
    def lock(self, account_id: str) -> str:
        """The account lock: a string holding the holder's random token."""
        return self._account("lock", account_id)

    def lock_queue(self, account_id: str) -> str:
        """The lock's FIFO list of blocking waiters' tokens."""
        return f"{self.lock(account_id)}:queue"

    def lock_waiters(self, account_id: str) -> str:
        """The lock's hash of waiter token -> lease expiry (Redis server milliseconds)."""
        return f"{self.lock(account_id)}:waiters"

    def lock_wake(self, account_id: str, waiter_token: str) -> str:
        """One waiter's wake-up list, pushed to when the lock is handed to it."""
        return f"{self.lock(account_id)}:wake:{waiter_token}"

    def alive(self, holder_id: str) -> str:
        """A worker process's liveness key (its own hash tag: not per account)."""
        return f"{self.prefix}:alive:{{{holder_id}}}"

    def holders(self) -> str:
        """The holders that beat lately: a sorted set of holder id -> last beat (ms since the
        epoch, the beater's clock), so the sweeper can tell whether any holder died."""
        return f"{self.prefix}:holders"

    # --- the gateway (payment_worker.gateway) ---------------------------------------------
    def token(self, account_id: str) -> str:
        """The account's shared access token (hash ``token``, ``lead_ms``)."""
        return self._account("token", account_id)

    def token_lock(self, account_id: str) -> str:
        """The lock of whoever refreshes the account's access token."""
        return self._account("token-lock", account_id)

    def pace(self, account_id: str) -> str:
        """The account's pacing bucket (hash ``tokens``, ``ts``, ``until``)."""
        return self._account("pace", account_id)

    # --- the drain loop and the sweeper (payment_worker.worker) ---------------------------
    def waiting(self, account_id: str) -> str:
        """The "work waiting" mark a task leaves when the account's lock is busy."""
        return self._account("waiting", account_id)

    def scheduled(self, account_id: str) -> str:
        """The mark of the account's one pending delayed message."""
        return self._account("scheduled", account_id)

    def swept(self, account_id: str) -> str:
        """The sweeper's mark: a repair message for the account was sent recently."""
        return self._account("swept", account_id)

    def queued(self, account_id: str) -> str:
        """When a message for the account was last published (ms since the epoch)."""
        return self._account("queued", account_id)

    def sweeper_lock(self) -> str:
        """The sweeper's own lock (one sweep at a time across all processes)."""
        return f"{self.prefix}:sweeper"

    def sweeper_tick(self) -> str:
        """Taken by the process that runs this interval's sweep (no hash tag: not per account)."""
        return f"{self.sweeper_lock()}:tick"

    def sweeper_waited(self) -> str:
        """When the oldest message waiting at the sweeper's last pass that found one was
        published (no hash tag: not per account)."""
        return f"{self.sweeper_lock()}:waited"

    # --- the producer (payment_worker.producer.submit) ------------------------------------
    def submit_dedup(self, batch_id: str) -> str:
        """The dedup window of a submitted batch id (no hash tag: not per account)."""
        return f"{self.prefix}:submit:{batch_id}"

    def submissions(self) -> str:
        """Submission counts by result (a hash), read by the exporter."""
        return f"{self.prefix}:submissions"
