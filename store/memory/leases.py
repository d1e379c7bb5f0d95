"""In-memory run leases with fencing tokens: ``LeaseManager`` semantics (SET NX PX, INCR) over dicts.

For unit tests only; the product takes leases in Redis (``store.leases``). Time comes from an injectable
clock, so expiry is simulated without sleeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from store import keys, owners, records
from store.memory.state import Clock, utc_now


@dataclass
class _Held:
    owner: str
    expires_at: datetime


@dataclass
class _Counter:
    value: int
    expires_at: datetime


@dataclass
class MemoryLeaseManager:
    """``LeaseManager`` semantics over dicts: SET NX PX leases and INCR fencing counters.

    ``flush_all`` drops every lease and counter, as a Redis restarted without persistence would.
    """

    ttl_ms: int
    clock: Clock = utc_now
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _leases: dict[str, _Held] = field(default_factory=dict, repr=False)
    _counters: dict[str, _Counter] = field(default_factory=dict, repr=False)

    def acquire(self, session_id: str, floor: int = 0) -> records.Lease | None:
        """Take the run's lease and mint a fencing token above ``floor``; ``None`` when held.

        A lease whose holder is provably gone (``owners.is_gone``) is taken over at once, as in Redis.

        Raises:
            SessionIdInvalidError: the id is not a valid run id (nothing is touched).
        """
        records.validate_session_id(session_id)
        with self._lock:
            now = self.clock()
            held = self._live(session_id, now)
            if held is not None and not owners.is_gone(held.owner):
                return None
            owner = owners.new_owner()
            self._leases[session_id] = _Held(owner, now + timedelta(milliseconds=self.ttl_ms))
            return records.Lease(session_id, owner, self._next_token(session_id, floor, now))

    def raise_token(self, lease: records.Lease, floor: int) -> bool:
        """Give ``lease`` a new token above ``floor`` if it is still held; False when it is not."""
        with self._lock:
            now = self.clock()
            held = self._live(lease.session_id, now)
            if held is None or held.owner != lease.owner:
                return False
            lease.token = self._next_token(lease.session_id, floor, now)
            return True

    def renew(self, lease: records.Lease) -> bool:
        """Push the lease's expiry out by one TTL; False (and ``lost`` set) when not ours anymore."""
        with self._lock:
            now = self.clock()
            held = self._live(lease.session_id, now)
            if held is None or held.owner != lease.owner:
                lease.lost.set()
                return False
            held.expires_at = now + timedelta(milliseconds=self.ttl_ms)
            return True

    def renew_many(self, leases: list[records.Lease]) -> None:
        """Renew several leases."""
        for lease in leases:
            self.renew(lease)

    def release(self, lease: records.Lease) -> bool:
        """Drop the lease if we still own it."""
        with self._lock:
            held = self._live(lease.session_id, self.clock())
            if held is None or held.owner != lease.owner:
                return False
            del self._leases[lease.session_id]
            return True

    def holder(self, session_id: str) -> str | None:
        """The owner id of the live lease on a run, if any.

        Raises:
            SessionIdInvalidError: the id is not a valid run id.
        """
        records.validate_session_id(session_id)
        with self._lock:
            held = self._live(session_id, self.clock())
            return None if held is None else held.owner

    def release_gone(self, session_ids: list[str]) -> list[str]:
        """Release the leases on these runs whose holder is provably gone; the runs freed."""
        with self._lock:
            now = self.clock()
            freed = []
            for sid in session_ids:
                held = self._live(records.validate_session_id(sid), now)
                if held is not None and owners.is_gone(held.owner):
                    del self._leases[sid]
                    freed.append(sid)
            return freed

    def held(self, session_ids: list[str]) -> set[str]:
        """Which of these runs have a live lease."""
        with self._lock:
            now = self.clock()
            return {sid for sid in session_ids if self._live(sid, now) is not None}

    def hold_as(self, session_id: str, owner: str) -> None:
        """Hold the run's lease under ``owner``, another process's id, as that process's SET NX PX would."""
        with self._lock:
            self._leases[session_id] = _Held(owner, self.clock() + timedelta(milliseconds=self.ttl_ms))

    def expire(self, session_id: str) -> None:
        """Let one run's lease time out now, as if its holder stalled past the TTL."""
        with self._lock:
            self._leases.pop(session_id, None)

    def flush_all(self) -> None:
        """Forget every lease and fencing counter (Redis lost its data)."""
        with self._lock:
            self._leases.clear()
            self._counters.clear()

    def _live(self, session_id: str, now: datetime) -> _Held | None:
        held = self._leases.get(session_id)
        if held is not None and now > held.expires_at:  # Redis keeps a key up to its expiry instant
            del self._leases[session_id]
            return None
        return held

    def _next_token(self, session_id: str, floor: int, now: datetime) -> int:
        counter = self._counters.get(session_id)
        current = 0 if counter is None or now > counter.expires_at else counter.value
        token = max(current, floor) + 1
        self._counters[session_id] = _Counter(token, now + timedelta(milliseconds=keys.FENCE_EXPIRE_MS))
        return token
