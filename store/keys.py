"""The whole Redis key layout of Lousho Worker (Celery's own broker keys aside).

``lousho:lease:{session_id}``  the run lease: value = owner id (``store.owners``: host, pid, process
                               start time, boot id, PID namespace, nonce), PX = lease TTL.
                               Taken with SET NX PX, renewed and released only by its owner (Lua).
``lousho:fence:{session_id}``  the fencing-token counter, INCR at every acquisition. Losing it is
                               safe: Postgres keeps the last claimed token and the next acquisition
                               raises the counter above it. Expires after 30 days of no use.

``lousho:watch:{session_id}``  set (PX) while a consumer reads the run's events: steps then publish to its
                               channel. Refreshed by the consumer; gone when nobody listens.
``lousho:abort:{session_id}``  doorbell of an abort request (the request itself is a column in Postgres);
                               the heartbeat rings the step, which checks Postgres before acting.
``lousho:steer:{session_id}``  the inbox number of the latest steer (input sent with ``steer``).
``lousho:events:{session_id}`` pub/sub channel: live signals and "new durable events" notes of the run.

``lousho:limits``               set of the ``ModelLimit`` keys in use (the sweep wakes their waiters).
``lousho:limit:{key}:held``    zset run id -> expiry (ms, Redis clock): the concurrent slots of a limit key; an entry
                               lives one lease TTL unless the call renews it, so a dead holder frees its slot.
``lousho:limit:{key}:woken``   zset run id -> expiry (ms): a slot kept for a waiter just woken (one lease TTL).
``lousho:limit:{key}:fair``    zset fairness key -> pass: the fairness keys with waiters, lowest pass served next.
``lousho:limit:{key}:passes``  hash: each fairness key's pass, ``w:{fairness key}`` its weight, ``~vt`` the last pass
                               served (a key that comes back starts there: no credit saved while it was away).
``lousho:limit:{key}:queue:{fairness key}``  zset run id -> time it began to wait: the waiters of one fairness key.
``lousho:limit:{key}:agents``  hash run id -> agent of each waiter (its step goes to that agent's queue).
``lousho:limit:{key}:conf``    hash: the numbers the last caller held the key to (what a wake-up goes by).
``lousho:limit:{key}:cool``    set (PX) while the key cools down after a 429/529 with ``Retry-After``.
``lousho:limit:{key}:rpm``, ``lousho:limit:{key}:tpm``  token buckets: hash level, ts (ms); expire when full.
``lousho:wait:{session_id}``   ``"{key} {reason}"`` (PX) while the run waits on a model limit: the sweep and the
                               pages read it (a wait that outlives it is the sweep's again).

Ids are validated (``records.validate_session_id``) before they are put into a key.
"""

from __future__ import annotations

LEASE_PREFIX = "lousho:lease:"
FENCE_PREFIX = "lousho:fence:"
WATCH_PREFIX = "lousho:watch:"
ABORT_PREFIX = "lousho:abort:"
STEER_PREFIX = "lousho:steer:"
CHANNEL_PREFIX = "lousho:events:"
LIMITS = "lousho:limits"
LIMIT_PREFIX = "lousho:limit:"
WAIT_PREFIX = "lousho:wait:"
FENCE_EXPIRE_MS = 30 * 24 * 3600 * 1000
#: How long an abort doorbell or a steer mark stays without a step to hear it (the request itself is durable).
SIGNAL_EXPIRE_MS = 3600 * 1000


def lease_key(session_id: str) -> str:
    """The lease key of a (validated) run id."""
    return LEASE_PREFIX + session_id


def fence_key(session_id: str) -> str:
    """The fencing-token counter key of a (validated) run id."""
    return FENCE_PREFIX + session_id


def watch_key(session_id: str) -> str:
    """The key set while a consumer reads the (validated) run's events."""
    return WATCH_PREFIX + session_id


def abort_key(session_id: str) -> str:
    """The abort doorbell of a (validated) run id."""
    return ABORT_PREFIX + session_id


def steer_key(session_id: str) -> str:
    """The latest steer's inbox number of a (validated) run id."""
    return STEER_PREFIX + session_id


def channel(session_id: str) -> str:
    """The pub/sub channel of a (validated) run's events."""
    return CHANNEL_PREFIX + session_id


def limit_key(key: str, part: str) -> str:
    """One structure of a (validated) ``ModelLimit`` key: ``held``, ``woken``, ``fair``, ``cool``, ``rpm``..."""
    return f"{LIMIT_PREFIX}{key}:{part}"


def wait_key(session_id: str) -> str:
    """The mark of a (validated) run waiting on a model limit."""
    return WAIT_PREFIX + session_id
