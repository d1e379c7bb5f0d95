"""The protocol floor: a bare Celery hop that also makes the round trips a strict Lousho step must make.

``--floor`` adds the system ``floor``: the bare chain's worker (``bench.bare``) whose every hop, before it
enqueues the next one, takes a Redis lease with a fencing token (one script: ``SET NX PX`` and ``INCR``),
claims the chain's row in Postgres with that token (one ``UPDATE ... RETURNING`` of the row), saves the hop's
payload to it fenced (one ``UPDATE`` that checks the fence and the sequence number) and releases the lease
(one compare-and-delete script). No step logic, no transcript, no history, no events: what is left of a Lousho
step once everything but its durable hand-over is taken away. ``floor/bare`` is what that hand-over costs on
this machine, and ``lousho/floor`` what Lousho's own code costs on top of it.

Each pool process keeps one Postgres connection (autocommit, prepared statements) and one Redis client, and
calls its scripts by hash as ``store.leases`` does. A chain's row is created by its first hop (one statement
more per chain: Lousho's producer creates a run's row when it sends the run). The table ``bench_floor`` lives
in the bench database (``prepare``). The drivers are imported only by the floor's worker, so the bare worker's
memory stays as it was.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store.settings import Settings

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
_SAVED = f"SELECT count(*) FROM {TABLE} WHERE chain LIKE %s AND seq = %s"
# The lease scripts, reduced to the round trips of ``store.leases`` (its acquire also keeps the counter's expiry
# and reads the run's signals: Lousho's own work, not the floor's).
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('INCR', KEYS[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class FloorError(RuntimeError):
    """A hop of the floor could not hand its chain over: busy, fenced out, out of order, or its row is missing."""


def prepare(database_url: str) -> None:
    """Create the floor's table in the bench database (freshly made by the bench, so empty)."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(_CREATE)


def finished(conn: Any, prefix: str, hops: int) -> int:
    """How many chains whose ids start with ``prefix`` saved all ``hops`` hops (``conn``: the bench database)."""
    row = conn.execute(_SAVED, (prefix.replace("_", r"\_") + "%", hops)).fetchone()
    return int(row[0]) if row else 0


class Floor:
    """One pool process's connections and scripts; ``hop`` makes one hop's round trips."""

    def __init__(self, database_url: str, redis_url: str) -> None:
        import psycopg
        import redis

        self.pid = os.getpid()
        self.db = psycopg.connect(database_url, autocommit=True)
        self.redis = redis.Redis.from_url(redis_url)
        self.scripts = {source: self.redis.script_load(source) for source in (_ACQUIRE, _RELEASE)}
        self.no_script = redis.exceptions.NoScriptError

    def _script(self, source: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return self.redis.evalsha(self.scripts[source], len(keys), *keys, *args)
        except self.no_script:  # the server lost its scripts (a restart): load it again
            self.scripts[source] = self.redis.script_load(source)
            return self.redis.evalsha(self.scripts[source], len(keys), *keys, *args)

    def lease(self, chain: str) -> tuple[str, int]:
        """Take the chain's lease: the owner id and the fencing token, token 0 when another holds it."""
        owner = uuid.uuid4().hex
        token = int(
            self._script(_ACQUIRE, [f"bench:floor:lease:{chain}", f"bench:floor:fence:{chain}"], [owner, LEASE_MS])
        )
        return owner, token

    def release(self, chain: str, owner: str) -> None:
        """Give the lease back if ``owner`` still holds it."""
        self._script(_RELEASE, [f"bench:floor:lease:{chain}"], [owner])

    def claim(self, chain: str, token: int, n: int) -> int:
        """Claim the chain for hop ``n`` with ``token``; the sequence number it is at (``n - 1``).

        Raises:
            FloorError: the claim was fenced out or found no row, or the chain is not at hop ``n - 1``
                (a hop delivered again, or out of order).
        """
        row = self.db.execute(_CLAIM, {"chain": chain, "token": token}, prepare=True).fetchone()
        if row is None:
            raise FloorError(f"chain {chain!r}: the claim at hop {n} was fenced out or found no row")
        if int(row[0]) != n - 1:
            raise FloorError(f"chain {chain!r}: hop {n} found the chain at hop {row[0]}")
        return n - 1

    def save(self, chain: str, token: int, seq: int, payload: str) -> None:
        """Save ``payload`` as hop ``seq + 1``'s result under ``token``.

        Raises:
            FloorError: a later claim took the chain (fenced out), or another save came first.
        """
        body = json.dumps({"hop": seq + 1, "result": payload})
        saved = self.db.execute(_SAVE, {"chain": chain, "token": token, "seq": seq, "body": body}, prepare=True)
        if saved.rowcount != 1:
            raise FloorError(f"chain {chain!r}: the save of hop {seq + 1} was fenced out")

    def hop(self, chain: str, n: int, payload: str) -> int:
        """Lease, claim, save ``payload`` as hop ``n``'s result, release; the sequence number saved.

        Raises:
            FloorError: the lease was held, the claim or the save was refused.
        """
        if n == 1:
            self.db.execute(_START, (chain,), prepare=True)
        owner, token = self.lease(chain)
        if not token:
            raise FloorError(f"chain {chain!r}: the lease was held at hop {n}")
        try:
            seq = self.claim(chain, token, n)
            self.save(chain, token, seq, payload)
        finally:
            self.release(chain, owner)
        return seq + 1


_floor: list[Floor] = []


def hop(chain: str, n: int, payload: str, settings: Settings) -> int:
    """``Floor.hop`` on this process's connections (made at its first hop, again after a fork)."""
    if not _floor or _floor[0].pid != os.getpid():
        _floor[:] = [Floor(settings.database_url, settings.redis_url)]
    return _floor[0].hop(chain, n, payload)


def enabled() -> bool:
    """Whether this worker is the floor's (``BENCH_FLOOR`` set)."""
    return bool(os.environ.get(ENV))
