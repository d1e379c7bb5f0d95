"""In-memory ``ModelLimit`` slots: ``RedisModelSlots`` semantics (slots with expiry, buckets, cool-down, fair line).

For unit tests only; the product holds limits in Redis (``store.model_slots``). Time comes from an injectable
clock, so expiry and refills are simulated without sleeping.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from store import records
from store.memory.state import Clock, utc_now
from store.model_limit import ModelLimit, SlotAnswer, SlotUsage, validate_fairness_key, validate_limit_key
from store.model_slots import DEFAULT_FAIRNESS_KEY, NUMBERS_WINDOW_MS


@dataclass
class _Key:
    held: dict[str, float] = field(default_factory=dict)  # run -> expiry (ms)
    woken: dict[str, float] = field(default_factory=dict)  # run -> expiry of the slot kept for it (ms)
    queues: dict[str, dict[str, float]] = field(default_factory=dict)  # fairness key -> run -> since (ms)
    fair: dict[str, float] = field(default_factory=dict)  # fairness key with waiters -> pass
    passes: dict[str, float] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    vt: float = 0.0
    agents: dict[str, str] = field(default_factory=dict)
    concurrent: int = 0
    cool_until: float = 0.0
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # "rpm"/"tpm" -> (level, ts ms)
    noted: dict[tuple[str, int], float] = field(default_factory=dict)  # (field, number) -> last noted (ms)


@dataclass
class MemoryModelSlots:
    """``RedisModelSlots`` over dicts, one lock; ``flush_all`` forgets everything as a Redis restart would."""

    ttl_ms: int
    clock: Clock = utc_now
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _keys: dict[str, _Key] = field(default_factory=dict, repr=False)
    _marks: dict[str, tuple[str, str, float]] = field(default_factory=dict, repr=False)

    def acquire(
        self, limit: ModelLimit, session_id: str, agent: str, fairness_key: str | None = None, weight: int = 1
    ) -> SlotAnswer:
        """Take a slot for one model call of the run, or say why not (``RedisModelSlots.acquire``).

        Raises:
            SessionIdInvalidError: the run id is not valid (nothing is touched).
            ConfigurationError: the fairness key is not valid.
        """
        records.validate_session_id(session_id)
        records.validate_agent_name(agent)
        fkey = DEFAULT_FAIRNESS_KEY if fairness_key is None else validate_fairness_key(fairness_key)
        with self._lock:
            now = self._now()
            state = self._keys.setdefault(limit.key, _Key())
            limit = ModelLimit(
                limit.key,
                *(
                    self._smallest(state, name, number or 0, now) or None
                    for name, number in (
                        ("concurrent", limit.concurrent),
                        ("rpm", limit.requests_per_minute),
                        ("tpm", limit.tokens_per_minute),
                    )
                ),
            )
            state.concurrent = limit.concurrent or 0
            self._purge(state, now)
            if state.cool_until > now:
                wait = state.cool_until - now
                self._marks[session_id] = (limit.key, "cool-down", now + wait + 15_000)
                return SlotAnswer(granted=False, reason="cool-down", wait_s=math.ceil(wait) / 1000)
            woken: tuple[tuple[str, str], ...] = ()
            if state.concurrent > 0 and session_id not in state.held:
                held, woken = self._take_slot(limit.key, state, session_id, agent, fkey, weight, now)
                if held is not None:
                    return held
            rpm_level = self._level(state, "rpm", limit.requests_per_minute or 0, now)
            tpm_level = self._level(state, "tpm", limit.tokens_per_minute or 0, now)
            timed = [
                (math.ceil((1 - level) * 60000 / per_minute), why)
                for level, per_minute, why in (
                    (rpm_level, limit.requests_per_minute, "requests"),
                    (tpm_level, limit.tokens_per_minute, "tokens"),
                )
                if per_minute and level < 1
            ]
            if timed:
                wait, reason = max(timed, key=lambda w: w[0])
                self._marks[session_id] = (limit.key, reason, now + wait + 15_000)
                return SlotAnswer.model_validate(
                    {"granted": False, "reason": reason, "wait_s": wait / 1000, "woken": woken}
                )
            if limit.requests_per_minute:
                state.buckets["rpm"] = (rpm_level - 1, now)
            state.held[session_id] = now + self.ttl_ms
            state.woken.pop(session_id, None)
            state.queues.get(fkey, {}).pop(session_id, None)
            state.agents.pop(session_id, None)
            self._marks.pop(session_id, None)
            return SlotAnswer(granted=True, woken=woken)

    def _take_slot(
        self, key: str, state: _Key, session_id: str, agent: str, fkey: str, weight: int, now: float
    ) -> tuple[SlotAnswer | None, tuple[tuple[str, str], ...]]:
        """A slot for a run that holds none: the wait (None: it may go on) and the other runs woken meanwhile."""
        reserved = session_id in state.woken
        free = state.concurrent - len(state.held) - len(state.woken) + (1 if reserved else 0)
        if reserved and free <= 0:  # the limit was lowered under it
            self._marks[session_id] = (key, "slot", now + self.ttl_ms)
            return SlotAnswer(granted=False, reason="slot"), ()
        if reserved or (free > 0 and not state.fair):
            return None, ()
        queue = state.queues.setdefault(fkey, {})
        if session_id not in queue:
            queue[session_id] = now
            state.agents[session_id] = agent
            state.weights[fkey] = max(1, weight)
            if fkey not in state.fair:
                state.fair[fkey] = max(state.vt, state.passes.get(fkey, 0.0))
        woken = self._pop(key, state, free, now) if free > 0 else []
        others = tuple(pair for pair in woken if pair[0] != session_id)
        if len(others) < len(woken):
            return None, others
        self._marks[session_id] = (key, "slot", now + 6 * 3600 * 1000)
        return SlotAnswer(granted=False, reason="slot", woken=others), ()

    def renew(self, key: str, session_ids: list[str]) -> int:
        """Push out the expiry of the slots of ``key`` these runs' calls hold; how many were still held.

        A lost slot is taken again, as in Redis: the call is in flight.
        """
        validate_limit_key(key)
        with self._lock:
            now = self._now()
            state = self._keys.setdefault(key, _Key())
            self._purge(state, now)
            kept = [sid for sid in session_ids if sid in state.held]
            for sid in session_ids:
                state.held[sid] = now + self.ttl_ms
            return len(kept)

    def release(self, limit: ModelLimit, session_id: str, tokens: int = 0) -> tuple[tuple[str, str], ...]:
        """Give back the run's slot, counting ``tokens`` in the minute's bucket; the runs woken."""
        records.validate_session_id(session_id)
        with self._lock:
            return self._release(limit.key, session_id, tokens, limit.tokens_per_minute or 0)

    def cool_down(self, key: str, seconds: float) -> None:
        """Hold every caller of ``key`` for ``seconds``; a longer cool-down stays."""
        validate_limit_key(key)
        with self._lock:
            state = self._keys.setdefault(key, _Key())
            state.cool_until = max(state.cool_until, self._now() + max(1, int(seconds * 1000)))

    def waiting(self, session_ids: list[str]) -> dict[str, tuple[str, str]]:
        """The runs among these that wait on a model limit: run id -> (limit key, reason)."""
        with self._lock:
            now = self._now()
            found = {}
            for sid in session_ids:
                mark = self._marks.get(records.validate_session_id(sid))
                if mark is not None and mark[2] >= now:
                    found[sid] = (mark[0], mark[1])
            return found

    def wake(self) -> tuple[tuple[str, str], ...]:
        """For every limit key: drop dead holders' slots and give the free ones to waiters; the runs woken."""
        with self._lock:
            woken: list[tuple[str, str]] = []
            for key in sorted(self._keys):
                woken.extend(self._release(key, "", 0, 0))
            return tuple(woken)

    def usage(self) -> list[SlotUsage]:
        """Slots in use, runs waiting and cool-down left, per limit key."""
        with self._lock:
            now = self._now()
            found = []
            for key in sorted(self._keys):
                state = self._keys[key]
                self._purge(state, now)
                found.append(
                    SlotUsage(
                        key=key,
                        in_use=len(state.held) + len(state.woken),
                        waiting=sum(len(q) for q in state.queues.values()),
                        cooling_s=max(0.0, state.cool_until - now) / 1000,
                    )
                )
            return found

    def flush_all(self) -> None:
        """Forget every slot, waiter, bucket and mark (Redis lost its data)."""
        with self._lock:
            self._keys.clear()
            self._marks.clear()

    def _now(self) -> float:
        return self.clock().timestamp() * 1000

    @staticmethod
    def _purge(state: _Key, now: float) -> None:
        for table in (state.held, state.woken):
            for sid in [sid for sid, expiry in table.items() if expiry <= now]:
                del table[sid]

    @staticmethod
    def _smallest(state: _Key, name: str, mine: int, now: float) -> int:
        """Note ``mine``; the smallest number noted for ``name`` within the window (0: unlimited, the largest)."""
        state.noted[(name, mine)] = now
        for stale in [k for k, seen in state.noted.items() if seen < now - NUMBERS_WINDOW_MS]:
            del state.noted[stale]
        numbers = [number for (kind, number) in state.noted if kind == name and number > 0]
        return min(numbers) if numbers else 0

    @staticmethod
    def _level(state: _Key, name: str, per_minute: int, now: float) -> float:
        kept = state.buckets.get(name)
        if kept is None:
            return float(per_minute)
        return min(float(per_minute), kept[0] + (now - kept[1]) * per_minute / 60000)

    def _release(self, key: str, session_id: str, tokens: int, tpm: int) -> tuple[tuple[str, str], ...]:
        state = self._keys.get(key)
        if state is None:
            return ()
        now = self._now()
        state.held.pop(session_id, None)
        self._purge(state, now)
        if tpm > 0 and tokens > 0:
            state.buckets["tpm"] = (self._level(state, "tpm", tpm, now) - tokens, now)
        free = state.concurrent - len(state.held) - len(state.woken) if state.concurrent > 0 else 100
        return tuple(self._pop(key, state, free, now)) if free > 0 else ()

    def _pop(self, key: str, state: _Key, n: int, now: float) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while n > 0 and state.fair:
            fkey = min(state.fair, key=lambda k: (state.fair[k], k))
            pass_ = state.fair[fkey]
            queue = state.queues.get(fkey, {})
            if not queue:
                del state.fair[fkey]
                continue
            sid = min(queue, key=lambda s: (queue[s], s))
            del queue[sid]
            after = pass_ + 1 / state.weights.get(fkey, 1)
            state.vt, state.passes[fkey] = pass_, after
            if queue:
                state.fair[fkey] = after
            else:
                del state.fair[fkey]
            state.woken[sid] = now + self.ttl_ms
            self._marks[sid] = (key, "slot", now + self.ttl_ms)
            out.append((sid, state.agents.pop(sid, "")))
            n -= 1
        return out
