"""The whole Redis key layout of Lousho Worker (Celery's own broker keys aside).

``lousho:lease:{session_id}``  the run lease: value = owner id (``host:pid:nonce``), PX = lease TTL.
                               Taken with SET NX PX, renewed and released only by its owner (Lua).
``lousho:fence:{session_id}``  the fencing-token counter, INCR at every acquisition. Losing it is
                               safe: Postgres keeps the last claimed token and the next acquisition
                               raises the counter above it. Expires after 30 days of no use.

Ids are validated (``records.validate_session_id``) before they are put into a key.
"""

from __future__ import annotations

LEASE_PREFIX = "lousho:lease:"
FENCE_PREFIX = "lousho:fence:"
FENCE_EXPIRE_MS = 30 * 24 * 3600 * 1000


def lease_key(session_id: str) -> str:
    """The lease key of a (validated) run id."""
    return LEASE_PREFIX + session_id


def fence_key(session_id: str) -> str:
    """The fencing-token counter key of a (validated) run id."""
    return FENCE_PREFIX + session_id
