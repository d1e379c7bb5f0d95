"""Run leases in Redis with fencing tokens, and the heartbeat that renews the ones held.

A lease only avoids duplicate work; correctness comes from the fencing token claimed in
Postgres (``checkpoints.PostgresCheckpointStore.claim``). Every change is a Lua script so a
lease is renewed or released only by its owner.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import redis

from store import errors, keys, owners, records
from store.records import Lease
from store.redis_client import translated

__all__ = ["Heartbeat", "LeaseManager"]

log = logging.getLogger(__name__)

# Taking and renewing a lease also read the run's signals in the same round trip: {watched, abort, steer}.
# KEYS: watch, abort, steer (after the script's own keys).
_SIGNALS = """
local function signals(first)
  return {redis.call('EXISTS', KEYS[first]), redis.call('EXISTS', KEYS[first + 1]),
          tonumber(redis.call('GET', KEYS[first + 2]) or '0') or 0}
end
"""

# Mint the next fencing token, above ``floor`` (KEYS[2] is the run's counter).
_MINT = """
local function mint(floor, expire_ms)
  local current = tonumber(redis.call('GET', KEYS[2]) or '0')
  if current < floor then redis.call('SET', KEYS[2], floor) end
  local token = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], expire_ms)
  return token
end
"""

# KEYS: lease, fence counter, then the signal keys. ARGV: owner, ttl ms, floor, counter expiry ms.
# When the lease is held, its holder comes back (so a dead holder can be told apart without another read).
_ACQUIRE = (
    _SIGNALS
    + _MINT
    + """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local token = mint(tonumber(ARGV[3]), ARGV[4])
  local heard = signals(3)
  return {token, heard[1], heard[2], heard[3]}
end
return {0, 0, 0, 0, redis.call('GET', KEYS[1])}
"""
)

# Take a lease over from a holder found gone, only while that holder still has it (another taker may have been
# first). KEYS: as _ACQUIRE. ARGV: the gone holder, owner, ttl ms, floor, counter expiry ms.
_TAKE_OVER = (
    _SIGNALS
    + _MINT
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  local token = mint(tonumber(ARGV[4]), ARGV[5])
  local heard = signals(3)
  return {token, heard[1], heard[2], heard[3]}
end
return {0, 0, 0, 0}
"""
)

# Mint a token above ``floor`` while still owning the lease (the counter was lost with a Redis wipe).
_RAISE = (
    _MINT
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return mint(tonumber(ARGV[2]), ARGV[3])
end
return 0
"""
)

# KEYS: lease, then the signal keys. ARGV: owner, ttl ms.
_RENEW = (
    _SIGNALS
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local heard = signals(2)
  return {redis.call('PEXPIRE', KEYS[1], ARGV[2]), heard[1], heard[2], heard[3]}
end
return {0, 0, 0, 0}
"""
)

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _text(value: Any) -> str | None:
    """A value read from Redis as text (the client may be set to return bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def _described(holder: str) -> str:
    """A gone holder as a log line names it (its pid; the rest of the id only says "this host")."""
    parsed = owners.parse(holder)
    return f"pid {parsed.pid} on this host" if parsed is not None else "unknown"


def _signal_keys(session_id: str) -> list[str]:
    """The keys of a run's signals, in the order the scripts read them."""
    return [keys.watch_key(session_id), keys.abort_key(session_id), keys.steer_key(session_id)]


def _renewed(lease: Lease, answer: Any) -> bool:
    """Apply a renewal's answer ``[held, watched, abort, steer]`` to ``lease``; whether it is still held."""
    held, watched, abort, steer = answer
    if not held:
        lease.lost.set()
        lease.wake.set()
        return False
    lease.hear(bool(watched), bool(abort), int(steer))
    return True


def _run(client: redis.Redis, script: Any, run_keys: list[str], args: list[Any]) -> Any:
    """``script(keys=run_keys, args=args)`` without redis-py's per-call Script overhead; loads it when missing."""
    try:
        return client.execute_command("EVALSHA", script.sha, len(run_keys), *run_keys, *args)  # type: ignore[no-untyped-call]
    except redis.exceptions.NoScriptError:
        return script(keys=run_keys, args=args)


class LeaseManager:
    """Takes, renews and releases run leases on one Redis client; Redis's errors come out as ``StorageError``."""

    def __init__(self, client: redis.Redis, ttl_ms: int) -> None:
        self._client = client
        self.ttl_ms = ttl_ms
        self._acquire = client.register_script(_ACQUIRE)
        self._take_over = client.register_script(_TAKE_OVER)
        self._raise = client.register_script(_RAISE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @translated
    def acquire(self, session_id: str, floor: int = 0) -> Lease | None:
        """Take the run's lease and mint a fencing token above ``floor``; ``None`` when held.

        A lease whose holder is provably gone (``owners.is_gone``: a process of this host that exited) is taken
        over at once, with a new token, instead of waiting for its TTL; any other holder keeps it.
        """
        records.validate_session_id(session_id)
        owner = owners.new_owner()
        run_keys = [keys.lease_key(session_id), keys.fence_key(session_id), *_signal_keys(session_id)]
        token, watched, abort, steer, *held = _run(
            self._client, self._acquire, run_keys, [owner, self.ttl_ms, floor, keys.FENCE_EXPIRE_MS]
        )
        if not token:
            holder = _text(held[0]) if held else None
            if holder is None or not owners.is_gone(holder):
                return None
            token, watched, abort, steer = self._take_over(
                keys=run_keys, args=[holder, owner, self.ttl_ms, floor, keys.FENCE_EXPIRE_MS]
            )
            if not token:
                return None
            log.info("lease of %s taken over at once: its holder (%s) is gone", session_id, _described(holder))
        lease = Lease(session_id, owner, int(token))
        lease.hear(bool(watched), bool(abort), int(steer))
        return lease

    @translated
    def raise_token(self, lease: Lease, floor: int) -> bool:
        """Give ``lease`` a new token above ``floor`` if it is still held; False when it is not."""
        token = int(
            self._raise(
                keys=[keys.lease_key(lease.session_id), keys.fence_key(lease.session_id)],
                args=[lease.owner, floor, keys.FENCE_EXPIRE_MS],
            )
        )
        if token:
            lease.token = token
        return bool(token)

    @translated
    def renew(self, lease: Lease) -> bool:
        """Push the lease's expiry out by one TTL; False (and ``lost`` set) when not ours anymore."""
        answer = self._renew(
            keys=[keys.lease_key(lease.session_id), *_signal_keys(lease.session_id)], args=[lease.owner, self.ttl_ms]
        )
        return _renewed(lease, answer)

    @translated
    def renew_many(self, leases: list[Lease]) -> None:
        """Renew several leases in one round trip (and hear their runs' signals)."""
        if not leases:
            return
        pipe = self._client.pipeline(transaction=False)
        for lease in leases:
            self._renew(
                keys=[keys.lease_key(lease.session_id), *_signal_keys(lease.session_id)],
                args=[lease.owner, self.ttl_ms],
                client=pipe,
            )
        for lease, answer in zip(leases, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(answer, Exception):
                log.warning("lease renewal failed for a run: %s", type(answer).__name__)
            else:
                _renewed(lease, answer)

    @translated
    def release(self, lease: Lease) -> bool:
        """Drop the lease if we still own it."""
        return bool(_run(self._client, self._release, [keys.lease_key(lease.session_id)], [lease.owner]))

    @translated
    def holder(self, session_id: str) -> str | None:
        """The owner id of the live lease on a run, if any."""
        return _text(self._client.get(keys.lease_key(records.validate_session_id(session_id))))

    @translated
    def release_gone(self, session_ids: list[str]) -> list[str]:
        """Release the leases on these runs whose holder is provably gone (``owners.is_gone``); the runs freed.

        Two round trips at most: one read of the holders, one compare-and-delete per gone holder (a holder
        that changed in between keeps its lease).
        """
        if not session_ids:
            return []
        lease_keys = [keys.lease_key(records.validate_session_id(sid)) for sid in session_ids]
        reads = self._client.pipeline(transaction=False)
        for key in lease_keys:
            reads.get(key)
        holders = [_text(value) for value in reads.execute()]
        gone = [
            (sid, key, holder)
            for sid, key, holder in zip(session_ids, lease_keys, holders, strict=True)
            if holder is not None and owners.is_gone(holder)
        ]
        if not gone:
            return []
        pipe = self._client.pipeline(transaction=False)
        for _, key, holder in gone:
            self._release(keys=[key], args=[holder], client=pipe)
        freed = [sid for (sid, _, _), done in zip(gone, pipe.execute(), strict=True) if done]
        for sid, _, holder in gone:
            if sid in freed:
                log.info("lease of %s released: its holder (%s) is gone", sid, _described(holder))
        return freed

    @translated
    def held(self, session_ids: list[str]) -> set[str]:
        """Which of these runs have a live lease (one round trip)."""
        if not session_ids:
            return set()
        pipe = self._client.pipeline(transaction=False)
        for session_id in session_ids:
            pipe.exists(keys.lease_key(session_id))
        return {sid for sid, live in zip(session_ids, pipe.execute(), strict=True) if live}


class Heartbeat:
    """One daemon thread per process renewing every lease its steps hold, every ``renew_ms``."""

    def __init__(self, manager: LeaseManager, renew_ms: int) -> None:
        self._manager = manager
        self._interval = renew_ms / 1000
        self._held: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def hold(self, lease: Lease) -> None:
        """Keep ``lease`` renewed until ``drop``."""
        with self._lock:
            self._held[lease.owner] = lease
            if self._thread is None or self._pid != os.getpid():
                # A forked child inherits the object but not the thread: start one of its own.
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="lousho-heartbeat", daemon=True)
                self._thread.start()

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``."""
        with self._lock:
            self._held.pop(lease.owner, None)

    def stop(self) -> None:
        """End the thread (tests and shutdown)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                leases = list(self._held.values())
            try:
                self._manager.renew_many(leases)
            except errors.StorageError as exc:
                # Renewal failing repeatedly lets the lease expire; the fence keeps saves safe.
                log.warning("lease heartbeat could not reach Redis: %s", type(exc).__name__)
