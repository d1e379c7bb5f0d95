"""The protocol floor: a bare Celery hop that also makes the round trips a strict Lousho step must make.

``--floor`` adds the system ``floor``: the bare chain's worker (``bench.bare``) whose every hop, before it
enqueues the next one, takes a Redis lease with a fencing token (one script: ``SET NX PX`` and ``INCR``),
claims the chain's row in Postgres with that token (one ``UPDATE ... RETURNING`` of the row), saves the hop's
payload to it fenced (one ``UPDATE`` that checks the fence and the sequence number) and releases the lease
(one compare-and-delete script). No step logic, no transcript, no history, no events: what is left of a Lousho
step once everything but its durable hand-over is taken away. ``floor/bare`` is what that hand-over costs on
this machine, and ``lousho/floor`` what Lousho's own code costs on top of it.

Each pool process keeps one Postgres connection (autocommit, prepared statements) and one Redis client. The
table ``bench_floor`` lives in the bench database (``prepare``). The drivers are imported only by the floor's
worker, so the bare worker's memory stays as it was.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

ENV = "BENCH_FLOOR"
TABLE = "bench_floor"
LEASE_MS = 30_000

_CREATE = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (chain text PRIMARY KEY, fence bigint NOT NULL, seq int NOT NULL, body jsonb)"
)
_START = f"INSERT INTO {TABLE} (chain, fence, seq) VALUES (%s, 0, 0) ON CONFLICT (chain) DO NOTHING"
_CLAIM = f"UPDATE {TABLE} SET fence = %(token)s WHERE chain = %(chain)s AND fence < %(token)s RETURNING seq, body"
_SAVE = (
    f"UPDATE {TABLE} SET seq = %(seq)s + 1, body = %(body)s::jsonb"
    " WHERE chain = %(chain)s AND fence = %(token)s AND seq = %(seq)s"
)
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('INCR', KEYS[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class FloorError(RuntimeError):
    """A hop of the floor could not hand its chain over: busy, fenced out, or its row is missing."""


def prepare(database_url: str) -> None:
    """Create the floor's table in the bench database (freshly made by the bench, so empty)."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(_CREATE)


class Floor:
    """One pool process's connections and scripts; ``hop`` makes one hop's round trips."""

    def __init__(self, database_url: str, redis_url: str) -> None:
        import psycopg
        import redis

        self.pid = os.getpid()
        self.db = psycopg.connect(database_url, autocommit=True)
        self.redis = redis.Redis.from_url(redis_url)
        self.acquire = self.redis.register_script(_ACQUIRE)
        self.release = self.redis.register_script(_RELEASE)

    def hop(self, chain: str, n: int, payload: str) -> int:
        """Lease, claim, save ``payload`` as hop ``n``'s result, release; the sequence number saved.

        Raises:
            FloorError: the lease was held, the claim or the save was fenced out, or the chain has no row.
        """
        if n == 1:
            self.db.execute(_START, (chain,), prepare=True)
        owner = uuid.uuid4().hex
        lease = f"bench:floor:lease:{chain}"
        token = int(self.acquire(keys=[lease, f"bench:floor:fence:{chain}"], args=[owner, LEASE_MS]))
        if not token:
            raise FloorError(f"chain {chain!r}: the lease was held at hop {n}")
        try:
            row = self.db.execute(_CLAIM, {"chain": chain, "token": token}, prepare=True).fetchone()
            if row is None:
                raise FloorError(f"chain {chain!r}: the claim at hop {n} was fenced out or found no row")
            seq = int(row[0])
            body = json.dumps({"hop": n, "result": payload})
            saved = self.db.execute(_SAVE, {"chain": chain, "token": token, "seq": seq, "body": body}, prepare=True)
            if saved.rowcount != 1:
                raise FloorError(f"chain {chain!r}: the save at hop {n} was fenced out")
        finally:
            self.release(keys=[lease], args=[owner])
        return seq + 1


_floor: list[Floor] = []


def hop(chain: str, n: int, payload: str, settings: Any) -> int:
    """``Floor.hop`` on this process's connections (made at its first hop, again after a fork)."""
    if not _floor or _floor[0].pid != os.getpid():
        _floor[:] = [Floor(settings.database_url, settings.redis_url)]
    return _floor[0].hop(chain, n, payload)


def enabled() -> bool:
    """Whether this worker is the floor's (``BENCH_FLOOR`` set)."""
    return bool(os.environ.get(ENV))
