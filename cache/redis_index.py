"""The Redis PrefixIndex: many gateways and many boxes share one view of who caches what.

    index = RedisPrefixIndex.from_config(cfg.redis, ttl_s=cfg.routing.block_ttl_s, on_recovered=refill)
    hits = await index.longest_prefix(chain_hashes(prompt_ids, block_size))   # {worker_id: blocks}
    ...
    await index.close()

Same contract as cache.index.PrefixIndex. Every method is one Lua script: one round trip, atomic.
Failures raise IndexUnavailable within `timeout_s` (RedisConfig.timeout_s), and for `retry_interval_s`
after one, calls raise at once (cache.redis_guard). `on_recovered` is called when Redis answers again
after failures, or when it answers with its contents gone (restarted without persistence): the
caller then asks every worker for a `snapshot`.

Layout (NS = RedisConfig.namespace):
- NS pfx:w:<worker>  sorted set: member = block hash, score = expires_epoch_s * 8 + tier_mask. Per-entry
                     expiry lives in the score; the key itself expires `ttl_s` after the worker's last
                     publish, so a worker that vanished without drop_worker frees its memory.
- NS pfx:workers     set of worker ids with entries
- NS pfx:epoch       a token written once; when it is missing, Redis lost its contents
A lookup reads each worker's set with ZMSCORE in growing chunks (16, 64, 256, ... blocks) and stops at
the first block the worker lacks, so its cost is the matched length, not the prompt length, and the
per-block work runs in Redis's C code rather than in Lua.
Standalone Redis only: scripts touch keys they compute (no Redis Cluster).
"""
from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Mapping, Sequence

import redis.asyncio as aioredis

from cache.index import ALL_TIERS, IndexUnavailable, PrefixIndex, Tier, tier_mask
from cache.redis_guard import RedisGuard, make_client

# ARGV[1] = namespace, ARGV[2] = a fresh epoch token (used only if none is stored)
_PROLOGUE = """
local ns = ARGV[1]
local now = tonumber(redis.call('TIME')[1])
local epoch = redis.call('GET', ns .. 'pfx:epoch')
if not epoch then epoch = ARGV[2]; redis.call('SET', ns .. 'pfx:epoch', epoch) end
local CHUNK = 4000  -- below Lua's unpack limit
local function live_mask(v)  -- tier bits of an entry score, 0 if absent or lapsed
  v = tonumber(v)
  if not v or math.floor(v / 8) <= now then return 0 end
  return v % 8
end
local function scores(key, first, last)  -- ZMSCORE of ARGV[first..last], chunked
  local out = {}
  for i = first, last, CHUNK do
    local part = redis.call('ZMSCORE', key, unpack(ARGV, i, math.min(i + CHUNK - 1, last)))
    for _, v in ipairs(part) do out[#out + 1] = v end
  end
  return out
end
local function zadd(key, pairs_)  -- pairs_ = {score, member, score, member, ...}
  for i = 1, #pairs_, CHUNK do
    redis.call('ZADD', key, unpack(pairs_, i, math.min(i + CHUNK - 1, #pairs_)))
  end
end
local function put(w, mask, ttl, first, last)  -- publish ARGV[first..last] for worker w
  if last < first then return end
  local key = ns .. 'pfx:w:' .. w
  local old = scores(key, first, last)
  local exp8 = (now + ttl) * 8
  local add = {}
  for i = first, last do
    add[#add + 1] = exp8 + bit.bor(live_mask(old[i - first + 1]), mask)
    add[#add + 1] = ARGV[i]
  end
  zadd(key, add)
end
local function touch(w, ttl)
  local key = ns .. 'pfx:w:' .. w
  redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. ((now + 1) * 8))  -- lapsed entries
  redis.call('EXPIRE', key, ttl)
  redis.call('SADD', ns .. 'pfx:workers', w)
end
"""

# ARGV[3] = worker, ARGV[4] = mask, ARGV[5] = ttl, ARGV[6..] = hashes
_PUBLISH = _PROLOGUE + """
local w, mask, ttl = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
put(w, mask, ttl, 6, #ARGV)
touch(w, ttl)
return epoch
"""

# ARGV[3] = worker, ARGV[4] = mask to clear, ARGV[5..] = hashes
_EVICT = _PROLOGUE + """
local w, clear = ARGV[3], tonumber(ARGV[4])
local key = ns .. 'pfx:w:' .. w
if redis.call('EXISTS', key) == 0 then return epoch end
local old = scores(key, 5, #ARGV)
local gone, keep = {}, {}
for i = 5, #ARGV do
  local v = tonumber(old[i - 4])
  if v then
    local m = v % 8
    m = m - bit.band(m, clear)
    if m == 0 then gone[#gone + 1] = ARGV[i]
    else keep[#keep + 1] = math.floor(v / 8) * 8 + m; keep[#keep + 1] = ARGV[i] end
  end
end
for i = 1, #gone, CHUNK do redis.call('ZREM', key, unpack(gone, i, math.min(i + CHUNK - 1, #gone))) end
zadd(key, keep)
return epoch
"""

# ARGV[3] = worker
_DROP = _PROLOGUE + """
redis.call('DEL', ns .. 'pfx:w:' .. ARGV[3])
redis.call('SREM', ns .. 'pfx:workers', ARGV[3])
return epoch
"""

# ARGV[3] = worker, ARGV[4] = ttl, then groups: mask, count, hash * count
_SNAPSHOT = _PROLOGUE + """
local w, ttl = ARGV[3], tonumber(ARGV[4])
redis.call('DEL', ns .. 'pfx:w:' .. w)
local i = 5
while i <= #ARGV do
  local mask, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  put(w, mask, ttl, i + 2, i + 1 + n)
  i = i + 2 + n
end
if redis.call('EXISTS', ns .. 'pfx:w:' .. w) == 1 then touch(w, ttl)
else redis.call('SREM', ns .. 'pfx:workers', w) end
return epoch
"""

# ARGV[3] = tier mask, ARGV[4..] = hashes in prefix order. Returns {epoch, w1, n1, w2, n2, ...}
_LONGEST = _PROLOGUE + """
local mask, first, last = tonumber(ARGV[3]), 4, #ARGV
local out = {epoch}
for _, w in ipairs(redis.call('SMEMBERS', ns .. 'pfx:workers')) do
  local key = ns .. 'pfx:w:' .. w
  local matched, i, size, open = 0, first, 16, true
  while open and i <= last do
    local j = math.min(i + size - 1, last)
    local part = redis.call('ZMSCORE', key, unpack(ARGV, i, j))
    for _, v in ipairs(part) do
      if bit.band(live_mask(v), mask) == 0 then open = false; break end
      matched = matched + 1
    end
    i, size = j + 1, math.min(size * 4, CHUNK)
  end
  if matched > 0 then out[#out + 1] = w; out[#out + 1] = matched end
end
return out
"""


class RedisPrefixIndex(PrefixIndex):
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "pulse:",
        ttl_s: float = 600.0,
        timeout_s: float = 0.05,
        retry_interval_s: float = 1.0,
        bulk_timeout_s: float = 5.0,
        on_recovered: Callable[[], object] | None = None,
    ):
        self._r = client
        self.namespace = namespace
        self.ttl_s = max(1, int(ttl_s))
        self.bulk_timeout_s = bulk_timeout_s  # snapshot and drop_worker move whole block sets
        self.guard = RedisGuard(timeout_s, retry_interval_s, IndexUnavailable, on_recovered)
        self._epoch: str | None = None
        self._scripts = {
            name: client.register_script(src)
            for name, src in (("publish", _PUBLISH), ("evict", _EVICT), ("drop", _DROP),
                              ("snapshot", _SNAPSHOT), ("longest", _LONGEST))
        }

    @classmethod
    def from_config(cls, redis_cfg, *, ttl_s: float = 600.0, on_recovered=None) -> RedisPrefixIndex:
        """From policy.config.RedisConfig (its url must be set)."""
        if not redis_cfg.url:
            raise ValueError("RedisPrefixIndex needs redis.url; use MemoryPrefixIndex on a single box")
        return cls(
            make_client(redis_cfg.url, redis_cfg.timeout_s),
            namespace=redis_cfg.namespace,
            ttl_s=ttl_s,
            timeout_s=redis_cfg.timeout_s,
            retry_interval_s=redis_cfg.retry_interval_s,
            on_recovered=on_recovered,
        )

    @property
    def available(self) -> bool:
        return self.guard.available

    async def publish(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        if hashes:
            await self._call("publish", [worker_id, tier_mask(tier), self.ttl_s, *hashes])

    async def evict(self, worker_id: str, hashes: Sequence[int], tier: Tier | None = None) -> None:
        if hashes:
            await self._call("evict", [worker_id, tier_mask(tier), *hashes])

    async def drop_worker(self, worker_id: str) -> None:
        await self._call("drop", [worker_id], self.bulk_timeout_s)

    async def snapshot(self, worker_id: str, blocks: Mapping[Tier, Sequence[int]]) -> None:
        args: list = [worker_id, self.ttl_s]
        for tier, hashes in blocks.items():
            args += [tier_mask(tier), len(hashes), *hashes]
        await self._call("snapshot", args, self.bulk_timeout_s)

    async def longest_prefix(self, hashes: Sequence[int], tiers: Collection[Tier] | None = None) -> dict[str, int]:
        if not hashes:
            return {}
        mask = ALL_TIERS if tiers is None else tier_mask(tiers)
        out = await self._call("longest", [mask, *hashes])
        return {out[i]: int(out[i + 1]) for i in range(1, len(out), 2)}

    async def close(self) -> None:
        await self._r.aclose()

    async def _call(self, name: str, args: list, timeout_s: float | None = None):
        script = self._scripts[name]
        return await self.guard.run(
            lambda: script(args=[self.namespace, secrets.token_hex(8), *args]), name, timeout_s, self._epoch_changed
        )

    def _epoch_changed(self, result) -> bool:
        """True when Redis restarted empty (or was flushed) since our last call: its entries are gone."""
        epoch = result[0] if isinstance(result, list) else result
        changed = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        return changed
