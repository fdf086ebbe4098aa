"""Real processes for the lock tests: run as ``python -m tests.lock_helpers <mode> ...``.

The environment (DATABASE_URL, REDIS_URL) comes from the ``pw_env`` fixture.

* ``contend``: one launcher imports everything once, then forks N children (real, separate
  processes with their own connections) that contend for one account lock; each child
  writes one JSON file with its intervals. Forking from a fresh, thread-free launcher
  keeps 100 processes cheap on a 2-core machine.
* ``hold``: takes the lock, prints one JSON line, then obeys commands on stdin
  (``write``, ``step``, ``ensure``, ``release``, ``exit``), one JSON line per answer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

GATEWAY_CALLS_KEY = "test:gateway_calls"
COUNTER_KEY = "test:counter"

# a fenced write the way the worker's statements are fenced (payment_worker.db.fences)
FENCED_UPDATE_SQL = """
WITH {fence},
upd AS (
    UPDATE transactions t SET status = :status, fence_token = :tok, updated_at = now()
    FROM fence WHERE t.id = :id
    RETURNING t.id
)
SELECT (SELECT count(*) FROM upd) AS updated, (SELECT count(*) FROM fence) AS fenced_ok
"""


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _clients(ttl_ms: int) -> tuple[Any, Any]:
    import redis

    from payment_worker.db.engine import make_engine
    from payment_worker.runtime import ServiceUrls
    from payment_worker.settings import Settings

    urls = ServiceUrls.resolve(Settings())
    r = redis.Redis.from_url(urls.redis, socket_timeout=5, socket_connect_timeout=5)
    engine = make_engine(urls.sqlalchemy, pool_size=1)
    return r, engine


def fenced_write(engine: Any, account_id: str, fence_token: int, tx_pk: int, status: str) -> str:
    """One fenced state write of a transaction row: "ok", "fenced_out" or "no_row"."""
    from sqlalchemy import text

    from payment_worker.db.fences import FENCE_CTE, execute_fenced
    from payment_worker.errors import FencedOut

    stmt = text(FENCED_UPDATE_SQL.format(fence=FENCE_CTE))
    try:
        with engine.begin() as conn:
            rows = execute_fenced(
                conn,
                stmt,
                {"status": status, "id": tx_pk},
                account_id=account_id,
                token=fence_token,
            )
            return "ok" if rows[0]["updated"] == 1 else "no_row"
    except FencedOut:
        return "fenced_out"


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when the launcher dies (no orphans after a timeout)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(args: argparse.Namespace, index: int, ready_key: str, go_key: str) -> None:
    from payment_worker.locks.account_lock import AccountLock

    _die_with_parent()
    r, engine = _clients(args.ttl_ms)
    out: dict[str, Any] = {"pid": os.getpid(), "index": index, "intervals": [], "waits": []}
    try:
        # warm up (connections, scripts) on another account, then wait for the start
        # signal: the measured contention is not a start-up storm of 100 processes
        warm = AccountLock(
            r, f"warm-{index}", engine=engine, ttl_ms=args.ttl_ms, safety_margin_ms=100
        )
        assert warm.acquire()
        warm.release()
        r.incr(ready_key)
        waited = 0
        while r.blpop([go_key], timeout=2) is None:  # shorter than the socket timeout
            waited += 2
            assert waited < 120, "no start signal"
        stop_at = time.time() + args.duration
        while True:
            lock = AccountLock(
                r, args.account, engine=engine, ttl_ms=args.ttl_ms, safety_margin_ms=100
            )
            t_req = time.time()
            if not lock.acquire(blocking=True, timeout=args.timeout):
                out["timed_out"] = True
                break
            start = time.time()
            # a non-atomic read-modify-write: the total is right only under mutual exclusion
            value = int(r.get(COUNTER_KEY) or 0)
            time.sleep(args.hold_ms / 1000)
            r.set(COUNTER_KEY, value + 1)
            lock.ensure_held()
            end = time.time()
            lock.release()
            out["intervals"].append([start, end, lock.fence_token])
            out["waits"].append(start - t_req)
            if time.time() >= stop_at:
                break
    except BaseException as exc:
        out["error"] = repr(exc)
    Path(args.out, f"child-{index}.json").write_text(json.dumps(out))


def contend(args: argparse.Namespace) -> int:
    """Fork ``args.n`` children that contend for one lock; wait for all of them."""
    from payment_worker.ops.logging import configure_logging

    configure_logging("WARNING")
    # import everything before forking so the children start at once
    import psycopg  # noqa: F401
    import sqlalchemy.dialects.postgresql.psycopg  # noqa: F401

    import payment_worker.db.engine
    import payment_worker.locks.account_lock  # noqa: F401

    Path(args.out).mkdir(parents=True, exist_ok=True)
    # per launcher, so that no other run's children can take this run's start signals
    ready_key, go_key = f"test:ready:{os.getpid()}", f"test:go:{os.getpid()}"
    pids = []
    for index in range(args.n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(args, index, ready_key, go_key)
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    # the parent's own connection, made after the forks
    r, _ = _clients(args.ttl_ms)
    deadline = time.monotonic() + 120
    while int(r.get(ready_key) or 0) < args.n and time.monotonic() < deadline:
        time.sleep(0.05)
    r.rpush(go_key, *([1] * args.n))
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += int(status != 0)
    return 1 if failed else 0


def hold(args: argparse.Namespace) -> int:
    """Take the lock, then follow commands from stdin."""
    from payment_worker.errors import LockLost
    from payment_worker.locks.account_lock import AccountLock
    from payment_worker.ops.logging import configure_logging

    configure_logging("WARNING")
    r, engine = _clients(args.ttl_ms)
    lost: list[str] = []
    lock = AccountLock(
        r,
        args.account,
        engine=engine,
        ttl_ms=args.ttl_ms,
        safety_margin_ms=args.margin_ms,
        on_lost=lost.append,
    )
    ok = lock.acquire(blocking=args.timeout > 0, timeout=args.timeout)
    _emit({"event": "acquired" if ok else "busy", "fence": lock.fence_token, "pid": os.getpid()})
    if not ok:
        return 1
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "write":
            result = fenced_write(
                engine, args.account, lock.fence_token or 0, int(rest[0]), rest[1]
            )
            _emit({"event": "write", "result": result})
        elif cmd == "step":
            # what processing does per side effect: check the lock, call the gateway, record
            try:
                lock.ensure_held()
            except LockLost as exc:
                _emit({"event": "step", "result": "lock_lost", "detail": str(exc)})
                continue
            r.incr(GATEWAY_CALLS_KEY)
            result = fenced_write(
                engine, args.account, lock.fence_token or 0, int(rest[0]), rest[1]
            )
            _emit({"event": "step", "result": result})
        elif cmd == "ensure":
            try:
                lock.ensure_held()
                _emit({"event": "ensure", "result": "held"})
            except LockLost:
                _emit({"event": "ensure", "result": "lost", "reason": lock.lost_reason})
        elif cmd == "release":
            _emit({"event": "release", "result": lock.release(), "on_lost": lost})
        elif cmd == "exit":
            break
    return 0


class TcpProxy:
    """A TCP forwarder to Redis that a test can cut (a real network fault, no mock)."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        # when set, the next data Redis sends on a connection is thrown away (then it is
        # cleared), and so is all that connection sends after it: the command ran, its reply is
        # lost, and the client, which times out, never reads a reply's tail as a whole reply
        # (a reply can reach the proxy in more than one read)
        self.drop_next_reply = threading.Event()
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                upstream = socket.create_connection(self._target)
                self._socks += [client, upstream]
            for a, b, drop in ((client, upstream, None), (upstream, client, self.drop_next_reply)):
                threading.Thread(target=self._pipe, args=(a, b, drop), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, drop: threading.Event | None) -> None:
        deaf = False
        try:
            while data := src.recv(65536):
                if drop is not None and drop.is_set():
                    drop.clear()
                    deaf = True
                if not deaf:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        with self._lock:
            self._cut = True
            socks, self._socks = self._socks, []
        self._server.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def reopen(self) -> None:
        """After :meth:`cut`: accept connections again, on the same port (Redis is back)."""
        server = socket.create_server(("127.0.0.1", self.port))
        with self._lock:
            self._server = server
            self._cut = False
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()


@contextlib.contextmanager
def proxied_redis(redis_url: str, retries: int = 1) -> Iterator[tuple[TcpProxy, redis.Redis]]:
    """A client of ``redis_url``'s database through a :class:`TcpProxy`, already connected
    (the next reply the proxy sees is the next command's), with a socket timeout of 0.5 s.
    ``retries``: a failed command is sent again at once that many times (1: what a
    ``REDIS_URL`` with ``retry_on_timeout=true`` asks for; 0: the runtime's clients by
    default, which redis-py 8 builds without retries)."""
    url = urlsplit(redis_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 6379)
    client = redis.Redis(
        port=proxy.port,
        db=int(url.path.strip("/") or 0),
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
        retry=Retry(NoBackoff(), retries),
    )
    try:
        client.ping()
        yield proxy, client
    finally:
        proxy.cut()
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lock_helpers")
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("contend")
    c.add_argument("--account", required=True)
    c.add_argument("--n", type=int, required=True)
    c.add_argument("--hold-ms", type=float, default=10)
    c.add_argument("--ttl-ms", type=int, default=1000)
    c.add_argument("--timeout", type=float, default=60)
    c.add_argument("--duration", type=float, default=0, help="keep acquiring this long (s)")
    c.add_argument("--out", required=True)
    h = sub.add_parser("hold")
    h.add_argument("--account", required=True)
    h.add_argument("--ttl-ms", type=int, default=1000)
    h.add_argument("--margin-ms", type=int, default=100)
    h.add_argument("--timeout", type=float, default=0)
    args = parser.parse_args(argv)
    return contend(args) if args.mode == "contend" else hold(args)


if __name__ == "__main__":
    sys.exit(main())
