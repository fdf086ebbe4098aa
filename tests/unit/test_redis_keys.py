"""Every Redis key name, pinned as a literal: running workers and runbooks depend on them."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import redis

from payment_worker.gateway.pacing import Pacer
from payment_worker.gateway.tokens import TokenManager
from payment_worker.locks.account_lock import lock_key
from payment_worker.redis_keys import RedisKeys

PACKAGE = Path(__file__).resolve().parents[2] / "payment_worker"


def test_every_key_format_is_pinned() -> None:
    k = RedisKeys("pw")
    assert k.lock("acct-1") == "pw:lock:{acct-1}"
    assert k.lock_queue("acct-1") == "pw:lock:{acct-1}:queue"
    assert k.lock_waiters("acct-1") == "pw:lock:{acct-1}:waiters"
    assert k.lock_wake("acct-1", "ab12") == "pw:lock:{acct-1}:wake:ab12"
    assert k.token("acct-1") == "pw:token:{acct-1}"
    assert k.token_lock("acct-1") == "pw:token-lock:{acct-1}"
    assert k.pace("acct-1") == "pw:pace:{acct-1}"
    assert k.waiting("acct-1") == "pw:waiting:{acct-1}"
    assert k.scheduled("acct-1") == "pw:scheduled:{acct-1}"
    assert k.swept("acct-1") == "pw:swept:{acct-1}"
    assert k.alive("host-7-ab12") == "pw:alive:{host-7-ab12}"
    assert k.sweeper_lock() == "pw:sweeper"
    assert k.sweeper_tick() == "pw:sweeper:tick"
    assert k.sweeper_waited() == "pw:sweeper:waited"
    assert k.submit_dedup("b-1") == "pw:submit:b-1"
    assert k.submissions() == "pw:submissions"


def test_the_prefix_is_the_only_variable_part() -> None:
    k = RedisKeys("other")
    assert k.lock("a") == "other:lock:{a}"
    assert k.lock_wake("a", "t") == "other:lock:{a}:wake:t"
    assert k.sweeper_lock() == "other:sweeper"
    assert k.submit_dedup("b") == "other:submit:b"
    assert RedisKeys() == RedisKeys("pw")  # the default of REDIS_KEY_PREFIX


def test_an_accounts_keys_share_one_cluster_hash_tag() -> None:
    k = RedisKeys("pw")
    per_account = [
        k.lock("a:b"),
        k.lock_queue("a:b"),
        k.lock_waiters("a:b"),
        k.lock_wake("a:b", "tok"),
        k.token("a:b"),
        k.token_lock("a:b"),
        k.pace("a:b"),
        k.waiting("a:b"),
        k.scheduled("a:b"),
        k.swept("a:b"),
    ]
    # Redis Cluster hashes only what is between the first "{" and the next "}"
    assert {key[key.index("{") + 1 : key.index("}")] for key in per_account} == {"a:b"}


def _no_fetch(account_id: str) -> httpx.Response:
    raise AssertionError("no token is fetched here")


def test_callers_spell_their_keys_through_the_module() -> None:
    client = redis.Redis()  # never connects: registering a script sends nothing
    assert lock_key("acct-1", "p") == RedisKeys("p").lock("acct-1")
    tokens = TokenManager(client, _no_fetch, prefix="p")
    assert tokens.token_key("a") == RedisKeys("p").token("a")
    assert tokens.lock_key("a") == RedisKeys("p").token_lock("a")
    assert Pacer(client, prefix="p").key("a") == RedisKeys("p").pace("a")


def test_no_key_format_outside_the_keys_module() -> None:
    # a hash tag in an f-string ("{{{"), or text glued to the configured prefix
    pattern = re.compile(r"\{\{\{|redis_key_prefix\}:|_prefix\}:")
    found = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "redis_keys.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
