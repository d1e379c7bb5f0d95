"""Fleet-wide model limits in Redis: concurrent slots with expiry, token buckets, one cool-down per key, fair waiters.

Every change is one Lua script on Redis's own clock, so every worker of the fleet sees one state. It must not
decide what a step does with an answer (``worker.slots`` does) nor hold a worker process while a run waits.
"""

from __future__ import annotations

from typing import Any

import redis

from store import keys, records
from store.model_limit import ModelLimit, SlotAnswer, SlotUsage, validate_fairness_key, validate_limit_key
from store.redis_client import translated

__all__ = ["DEFAULT_FAIRNESS_KEY", "RedisModelSlots"]

#: The fairness key of runs sent without one (a fairness key given by a caller cannot start with ``~``).
DEFAULT_FAIRNESS_KEY = "~"
#: How long a slot-wait mark lives without a wake-up (the sweep's wake pass frees slots of dead holders long before).
SLOT_WAIT_MARK_MS = 6 * 3600 * 1000
#: How long past its due time a timed wait's mark lives (its countdown message should have come by then).
TIMED_WAIT_MARGIN_MS = 15_000
#: How long the numbers a caller held a key to count after its last call: within it, the smallest holds.
NUMBERS_WINDOW_MS = 60_000
#: How long the fairness passes of a limit key are kept without any change.
PASSES_EXPIRE_MS = 24 * 3600 * 1000

# KEYS (every script): 1 held, 2 woken, 3 fair, 4 passes, 5 agents, 6 cool, 7 rpm, 8 tpm, 9 conf, 10 the key set.
_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function purge(now)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
end

-- Give up to n freed slots to waiters, the fairness key with the lowest pass first; {sid, agent, sid, agent...}.
local function pop(n, now, queue_prefix, mark_prefix, woken_ms, key, passes_ms)
  local out = {}
  while n > 0 do
    local head = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    if #head == 0 then break end
    local fkey, pass = head[1], tonumber(head[2])
    local queue = queue_prefix .. fkey
    local popped = redis.call('ZPOPMIN', queue)
    if #popped == 0 then
      redis.call('ZREM', KEYS[3], fkey)
    else
      local sid = popped[1]
      local weight = tonumber(redis.call('HGET', KEYS[4], 'w:' .. fkey) or '1') or 1
      local after = pass + 1 / weight
      redis.call('HSET', KEYS[4], '~vt', pass, fkey, after)
      redis.call('PEXPIRE', KEYS[4], passes_ms)
      if redis.call('ZCARD', queue) == 0 then redis.call('ZREM', KEYS[3], fkey)
      else redis.call('ZADD', KEYS[3], after, fkey) end
      redis.call('ZADD', KEYS[2], now + woken_ms, sid)
      redis.call('SET', mark_prefix .. sid, key .. ' slot', 'PX', woken_ms)
      out[#out + 1] = sid
      out[#out + 1] = redis.call('HGET', KEYS[5], sid) or ''
      redis.call('HDEL', KEYS[5], sid)
      n = n - 1
    end
  end
  return out
end

local function free_slots(concurrent)
  return concurrent - redis.call('ZCARD', KEYS[1]) - redis.call('ZCARD', KEYS[2])
end

-- Each caller notes the number it holds the key to; the smallest noted within the window holds (two releases giving
-- one key different numbers during a deploy). 0 is unlimited: any number is smaller.
local function smallest(field, mine, now, window)
  redis.call('HSET', KEYS[9], field .. ':' .. mine, now)
  local best = mine
  local noted = redis.call('HGETALL', KEYS[9])
  for i = 1, #noted, 2 do
    local kind, number = string.match(noted[i], '^(%a+):(%d+)$')
    if kind == field then
      if tonumber(noted[i + 1]) < now - window then
        redis.call('HDEL', KEYS[9], noted[i])
      else
        number = tonumber(number)
        if number > 0 and (best == 0 or number < best) then best = number end
      end
    end
  end
  return best
end

local function level(bucket, per_minute, now)
  local v = redis.call('HMGET', bucket, 'level', 'ts')
  local lvl, ts = tonumber(v[1]), tonumber(v[2])
  if not lvl then return per_minute end
  return math.min(per_minute, lvl + (now - ts) * per_minute / 60000)
end

local function keep(bucket, lvl, now)
  redis.call('HSET', bucket, 'level', lvl, 'ts', now)
  redis.call('PEXPIRE', bucket, 120000)
end
"""

# ARGV: 1 sid, 2 agent, 3 fairness key, 4 weight, 5 concurrent, 6 rpm, 7 tpm, 8 ttl ms, 9 queue prefix,
# 10 mark prefix, 11 limit key, 12 slot-wait mark ms, 13 timed-wait margin ms, 14 woken ms, 15 passes expiry ms,
# 16 how long a caller's numbers count (ms).
# Answer: {granted, reason, wait ms, woken sid, woken agent, ...}.
_ACQUIRE = (
    _COMMON
    + """
local sid, fkey = ARGV[1], ARGV[3]
local queue_prefix, mark_prefix, key = ARGV[9], ARGV[10], ARGV[11]
local woken_ms = tonumber(ARGV[14])
local mark = mark_prefix .. sid
local now = now_ms()
local window = tonumber(ARGV[16])
local concurrent = smallest('concurrent', tonumber(ARGV[5]), now, window)
local rpm = smallest('rpm', tonumber(ARGV[6]), now, window)
local tpm = smallest('tpm', tonumber(ARGV[7]), now, window)
redis.call('SADD', KEYS[10], key)
redis.call('HSET', KEYS[9], 'concurrent', concurrent)
redis.call('PEXPIRE', KEYS[9], window * 10)
purge(now)
local cool = redis.call('PTTL', KEYS[6])
if cool > 0 then
  redis.call('SET', mark, key .. ' cool-down', 'PX', cool + tonumber(ARGV[13]))
  return {0, 'cool-down', cool}
end
local woken = {}
if concurrent > 0 and not redis.call('ZSCORE', KEYS[1], sid) then
  local reserved = redis.call('ZSCORE', KEYS[2], sid)
  local free = free_slots(concurrent)
  if reserved then free = free + 1 end
  if not reserved and (free <= 0 or redis.call('ZCARD', KEYS[3]) > 0) then
    -- Wait in line, behind the runs already waiting (by fairness key); free slots go to the line's head.
    local queue = queue_prefix .. fkey
    if not redis.call('ZSCORE', queue, sid) then
      redis.call('ZADD', queue, now, sid)
      redis.call('HSET', KEYS[5], sid, ARGV[2])
      redis.call('HSET', KEYS[4], 'w:' .. fkey, ARGV[4])
      redis.call('PEXPIRE', KEYS[4], ARGV[15])
      if not redis.call('ZSCORE', KEYS[3], fkey) then
        local vt = tonumber(redis.call('HGET', KEYS[4], '~vt') or '0') or 0
        local own = tonumber(redis.call('HGET', KEYS[4], fkey) or '0') or 0
        redis.call('ZADD', KEYS[3], math.max(vt, own), fkey)
      end
    end
    if free > 0 then woken = pop(free, now, queue_prefix, mark_prefix, woken_ms, key, ARGV[15]) end
    local others, mine = {}, false
    for i = 1, #woken, 2 do
      if woken[i] == sid then mine = true else
        others[#others + 1] = woken[i]
        others[#others + 1] = woken[i + 1]
      end
    end
    woken = others
    if not mine then
      redis.call('SET', mark, key .. ' slot', 'PX', ARGV[12])
      return {0, 'slot', 0, unpack(woken)}
    end
  elseif free <= 0 then
    redis.call('SET', mark, key .. ' slot', 'PX', woken_ms)
    return {0, 'slot', 0}
  end
end
local rpm_level, tpm_level
local wait, reason = 0, ''
if rpm > 0 then
  rpm_level = level(KEYS[7], rpm, now)
  if rpm_level < 1 then wait, reason = math.ceil((1 - rpm_level) * 60000 / rpm), 'requests' end
end
if tpm > 0 then
  tpm_level = level(KEYS[8], tpm, now)
  if tpm_level < 1 then
    local need = math.ceil((1 - tpm_level) * 60000 / tpm)
    if need > wait then wait, reason = need, 'tokens' end
  end
end
if wait > 0 then
  redis.call('SET', mark, key .. ' ' .. reason, 'PX', wait + tonumber(ARGV[13]))
  return {0, reason, wait, unpack(woken)}
end
if rpm > 0 then keep(KEYS[7], rpm_level - 1, now) end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[8]), sid)
redis.call('ZREM', KEYS[2], sid)
redis.call('ZREM', queue_prefix .. fkey, sid)
redis.call('HDEL', KEYS[5], sid)
redis.call('DEL', mark)
return {1, '', 0, unpack(woken)}
"""
)

# ARGV: 1 sid ('' for a wake-up pass), 2 tokens used, 3 tpm, 4 queue prefix, 5 mark prefix, 6 limit key,
# 7 woken ms, 8 passes expiry ms. Answer: {woken sid, woken agent, ...}.
_RELEASE = (
    _COMMON
    + """
local now = now_ms()
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
purge(now)
local tokens, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and tokens > 0 then keep(KEYS[8], level(KEYS[8], tpm, now) - tokens, now) end
local concurrent = tonumber(redis.call('HGET', KEYS[9], 'concurrent') or '0') or 0
-- A key no longer limited lets its last waiters go.
local free = concurrent > 0 and free_slots(concurrent) or 100
if free > 0 then return pop(free, now, ARGV[4], ARGV[5], tonumber(ARGV[7]), ARGV[6], ARGV[8]) end
return {}
"""
)

# ARGV: ttl ms, then run ids. Pushes out the expiry of the slots of these runs, whose calls are in flight: a slot
# lost (Redis lost its keys, or the holder stalled past its expiry) counts again, as the call does.
_RENEW = (
    _COMMON
    + """
local now = now_ms()
local kept = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then kept = kept + 1 end
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
end
return kept
"""
)

# ARGV: ms. A cool-down only ever grows.
_COOL = """
if redis.call('PTTL', KEYS[6]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[6], '1', 'PX', ARGV[1])
end
return 1
"""

# ARGV: queue prefix. Answer: {in use, waiting, cool-down ms}.
_USAGE = (
    _COMMON
    + """
purge(now_ms())
local waiting = 0
for _, fkey in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  waiting = waiting + redis.call('ZCARD', ARGV[1] .. fkey)
end
return {redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]), waiting, math.max(0, redis.call('PTTL', KEYS[6]))}
"""
)

_PARTS = ("held", "woken", "fair", "passes", "agents", "cool", "rpm", "tpm", "conf")


def _keys_of(key: str) -> list[str]:
    return [*(keys.limit_key(key, part) for part in _PARTS), keys.LIMITS]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: list[Any]) -> tuple[tuple[str, str], ...]:
    return tuple((_text(flat[i]), _text(flat[i + 1])) for i in range(0, len(flat) - 1, 2))


class RedisModelSlots:
    """``ModelLimit`` slots, buckets and cool-downs on one Redis client, shared by every worker of the fleet."""

    def __init__(self, client: redis.Redis, ttl_ms: int) -> None:
        self._client = client
        #: How long a slot lives without a renewal (the lease TTL: a dead holder frees its slot within it).
        self.ttl_ms = ttl_ms
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._cool = client.register_script(_COOL)
        self._usage = client.register_script(_USAGE)

    @translated
    def acquire(
        self, limit: ModelLimit, session_id: str, agent: str, fairness_key: str | None = None, weight: int = 1
    ) -> SlotAnswer:
        """Take a slot (and a request from the minute's bucket) for one model call of the run, or say why not.

        A run that finds no free slot waits in line under its fairness key; the answer then says ``slot`` and the
        run is woken (in a later ``acquire``'s, ``release``'s or ``wake``'s answer) when a slot is kept for it.

        Raises:
            SessionIdInvalidError: the run id is not valid (nothing is touched).
            ConfigurationError: the fairness key is not valid.
        """
        records.validate_session_id(session_id)
        records.validate_agent_name(agent)
        fkey = DEFAULT_FAIRNESS_KEY if fairness_key is None else validate_fairness_key(fairness_key)
        answer = self._acquire(
            keys=_keys_of(limit.key),
            args=[
                session_id,
                agent,
                fkey,
                max(1, weight),
                limit.concurrent or 0,
                limit.requests_per_minute or 0,
                limit.tokens_per_minute or 0,
                self.ttl_ms,
                keys.limit_key(limit.key, "queue:"),
                keys.WAIT_PREFIX,
                limit.key,
                SLOT_WAIT_MARK_MS,
                TIMED_WAIT_MARGIN_MS,
                self.ttl_ms,
                PASSES_EXPIRE_MS,
                NUMBERS_WINDOW_MS,
            ],
        )
        granted, reason, wait_ms, *woken = answer
        return SlotAnswer.model_validate(
            {
                "granted": bool(granted),
                "reason": None if granted else _text(reason),
                "wait_s": int(wait_ms) / 1000,
                "woken": _pairs(woken),
            }
        )

    @translated
    def renew(self, key: str, session_ids: list[str]) -> int:
        """Push out the expiry of the slots of ``key`` these runs' calls in flight hold; how many were still held.

        A slot that was lost (Redis lost its keys, or the holder stalled past its expiry) is taken again: the call
        is in flight, so it counts, and calls admitted in between are the only excess (I20).
        """
        if not session_ids:
            return 0
        return int(self._renew(keys=_keys_of(validate_limit_key(key)), args=[self.ttl_ms, *session_ids]))

    @translated
    def release(self, limit: ModelLimit, session_id: str, tokens: int = 0) -> tuple[tuple[str, str], ...]:
        """Give back the run's slot, counting ``tokens`` (reported usage) in the minute's bucket; the runs woken."""
        records.validate_session_id(session_id)
        return self._run_release(limit.key, session_id, tokens, limit.tokens_per_minute or 0)

    @translated
    def cool_down(self, key: str, seconds: float) -> None:
        """Hold every caller of ``key`` for ``seconds`` (a provider's ``Retry-After``); a longer one stays."""
        ms = max(1, int(seconds * 1000))
        self._cool(keys=_keys_of(validate_limit_key(key)), args=[ms])

    @translated
    def waiting(self, session_ids: list[str]) -> dict[str, tuple[str, str]]:
        """The runs among these that wait on a model limit: run id -> (limit key, reason)."""
        if not session_ids:
            return {}
        marks = self._client.mget([keys.wait_key(records.validate_session_id(sid)) for sid in session_ids])
        found = {}
        for sid, mark in zip(session_ids, marks, strict=True):
            if mark is not None:
                key, _, reason = _text(mark).partition(" ")
                found[sid] = (key, reason)
        return found

    @translated
    def wake(self) -> tuple[tuple[str, str], ...]:
        """For every limit key: drop the slots of dead holders and give the free ones to waiters; the runs woken."""
        woken: list[tuple[str, str]] = []
        for key in sorted(_text(k) for k in self._client.smembers(keys.LIMITS)):
            woken.extend(self._run_release(validate_limit_key(key), "", 0, 0))
        return tuple(woken)

    @translated
    def usage(self) -> list[SlotUsage]:
        """Slots in use (kept for a woken waiter included), runs waiting and cool-down left, per limit key."""
        found = []
        for key in sorted(_text(k) for k in self._client.smembers(keys.LIMITS)):
            in_use, waiting, cool_ms = self._usage(
                keys=_keys_of(validate_limit_key(key)), args=[keys.limit_key(key, "queue:")]
            )
            found.append(SlotUsage(key=key, in_use=int(in_use), waiting=int(waiting), cooling_s=int(cool_ms) / 1000))
        return found

    def _run_release(self, key: str, session_id: str, tokens: int, tpm: int) -> tuple[tuple[str, str], ...]:
        return _pairs(
            self._release(
                keys=_keys_of(key),
                args=[
                    session_id,
                    max(0, tokens),
                    tpm,
                    keys.limit_key(key, "queue:"),
                    keys.WAIT_PREFIX,
                    key,
                    self.ttl_ms,
                    PASSES_EXPIRE_MS,
                ],
            )
        )
