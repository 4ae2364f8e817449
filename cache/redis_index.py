"""The Redis PrefixIndex: many gateways and many boxes share one view of who caches what.

    index = RedisPrefixIndex.from_config(cfg.redis, ttl_s=cfg.routing.block_ttl_s, on_recovered=refill)
    await index.connect()                 # optional: loads the scripts within the bulk timeout
    hits = await index.longest_prefix(chain_hashes(prompt_ids, block_size))   # {worker_id: blocks}
    ...
    await index.close()

Same contract as cache.index.PrefixIndex. Every method is one Lua script: one round trip, atomic.
Failures raise IndexUnavailable within `timeout_s` (RedisConfig.timeout_s), and for `retry_interval_s`
after one, calls raise at once (cache.redis_guard). `on_recovered` is called when Redis answers again
after failures, or when it answers with its contents gone (restarted without persistence): the
caller then asks every worker for a `snapshot`.

Layout (NS = RedisConfig.namespace):
- NS pfx:w:<worker>:<tier>  set of the block hashes the worker holds in that tier (gpu, host, checkpoint)
- NS pfx:workers            set of worker ids with entries
- NS pfx:epoch              a token written once; when it is missing, Redis lost its contents
Expiry is per worker: its sets expire `ttl_s` after its last publish, evict or snapshot, so a worker
that died without drop_worker vanishes; single lost evictions are repaired by the snapshot a worker
sends when `on_recovered` fires (and periodically).
A lookup first brackets each worker's match with a few batched probes (blocks 1, 2, 4, ..., last in one
SMISMEMBER, then 15 evenly spaced points inside the bracket until it is <= 16 blocks wide: the engines
evict a block's descendants before the block, so held blocks form a prefix), then checks every block up
to the bracket's upper end in one SMISMEMBER and returns the first gap. The answer is exact whether or
not the held blocks form a prefix (the dense check finds any gap; the block past the bracket is known
missing), and the per-block work is the matched length plus at most 15 blocks, in Redis's C code.
With `exact=False` the dense check covers only the first 16 blocks and the bracket's last <= 16: the
answer is then exact when the blocks a worker holds past the 16th form a prefix, which the engines keep
(the CPU/CuPy engine frees a sequence's blocks tail first and re-touches a block's ancestors whenever the
block is reused, so LRU evicts descendants first; llama-server slots hold whole prefixes); a gap left by a
lost eviction event (repaired by the next snapshot) may then be counted as held. It checks ~W x 60 blocks
instead of the matched lengths: for long agent contexts across many workers that is the difference
between ~1.5 ms and a fraction of it (bench/prefix_lookup.py).
(Before, growing chunks of 16, 64, 256, ... blocks overshot the match by up to 4x. Measured on the loaded
2-core box: SMISMEMBER ~0.5 µs per block inside a script, against ~1.9 µs for ZMSCORE and ~1 µs for HMGET.)
Standalone Redis only: scripts touch keys they compute (no Redis Cluster).
"""
from __future__ import annotations

import secrets
import struct
from collections.abc import Callable, Collection, Mapping, Sequence

import redis.asyncio as aioredis

from cache.index import ALL_TIERS, TIER_BITS, IndexUnavailable, PrefixIndex, Tier, tier_mask
from cache.redis_guard import RedisGuard, make_client

# ARGV[1] = namespace, ARGV[2] = a fresh epoch token (used only if none is stored).
# Hash lists travel as one binary argument of 8-byte big-endian hashes: packing 1,000 separate
# arguments cost the client ~2-3 ms in redis-py, against one struct.pack call.
_PROLOGUE = """
local ns = ARGV[1]
local epoch = redis.call('GET', ns .. 'pfx:epoch')
if not epoch then epoch = ARGV[2]; redis.call('SET', ns .. 'pfx:epoch', epoch) end
local CHUNK = 4000  -- below Lua's unpack limit
local TIERS = {{'gpu', 1}, {'host', 2}, {'checkpoint', 4}}
local function tier_keys(w, mask)
  local keys = {}
  for _, t in ipairs(TIERS) do
    if bit.band(mask, t[2]) ~= 0 then keys[#keys + 1] = ns .. 'pfx:w:' .. w .. ':' .. t[1] end
  end
  return keys
end
local function split(blob, first, last)  -- hashes first..last (1-based) of a packed blob
  local out = {}
  for i = first, last do out[#out + 1] = string.sub(blob, 8 * i - 7, 8 * i) end
  return out
end
local function each_chunk(cmd, key, blob)
  local n = #blob / 8
  for i = 1, n, CHUNK do redis.call(cmd, key, unpack(split(blob, i, math.min(i + CHUNK - 1, n)))) end
end
local function touch(w, ttl)  -- the worker is alive: its entries live ttl more seconds
  local alive = false
  for _, key in ipairs(tier_keys(w, 7)) do
    if redis.call('EXPIRE', key, ttl) == 1 then alive = true end
  end
  if alive then redis.call('SADD', ns .. 'pfx:workers', w) else redis.call('SREM', ns .. 'pfx:workers', w) end
end
local function drop(w)
  redis.call('DEL', unpack(tier_keys(w, 7)))
  redis.call('SREM', ns .. 'pfx:workers', w)
end
"""

# ARGV[3] = worker, ARGV[4] = tier name, ARGV[5] = ttl, ARGV[6] = hashes
_PUBLISH = _PROLOGUE + """
each_chunk('SADD', ns .. 'pfx:w:' .. ARGV[3] .. ':' .. ARGV[4], ARGV[6])
touch(ARGV[3], tonumber(ARGV[5]))
return epoch
"""

# ARGV[3] = worker, ARGV[4] = tier mask, ARGV[5] = ttl, ARGV[6] = hashes
_EVICT = _PROLOGUE + """
for _, key in ipairs(tier_keys(ARGV[3], tonumber(ARGV[4]))) do each_chunk('SREM', key, ARGV[6]) end
touch(ARGV[3], tonumber(ARGV[5]))
return epoch
"""

# ARGV[3] = worker
_DROP = _PROLOGUE + """
drop(ARGV[3])
return epoch
"""

# ARGV[3] = worker, ARGV[4] = ttl, then pairs: tier name, hashes
_SNAPSHOT = _PROLOGUE + """
local w = ARGV[3]
drop(w)
for i = 5, #ARGV, 2 do each_chunk('SADD', ns .. 'pfx:w:' .. w .. ':' .. ARGV[i], ARGV[i + 1]) end
touch(w, tonumber(ARGV[4]))
return epoch
"""

# ARGV[3] = tier mask, ARGV[4] = hashes in prefix order, ARGV[5] = "1": dense check, "0": probes only.
# Returns {epoch, w1, n1, w2, n2, ...}
_LONGEST = _PROLOGUE + """
local mask, blob, dense = tonumber(ARGV[3]), ARGV[4], ARGV[5] == '1'
local last = #blob / 8
local hashes = {}  -- split lazily: only as deep as some worker matches
local function upto(j)
  if j > #hashes then
    for _, h in ipairs(split(blob, #hashes + 1, j)) do hashes[#hashes + 1] = h end
  end
end
local function held(keys, list, i, j)  -- per hash list[i..j]: held in any of keys? (1 or 0)
  local got = redis.call('SMISMEMBER', keys[1], unpack(list, i, j))
  for t = 2, #keys do
    local more = redis.call('SMISMEMBER', keys[t], unpack(list, i, j))
    for k = 1, #got do if more[k] == 1 then got[k] = 1 end end
  end
  return got
end
local function bracket(keys)  -- lo held (or 0), hi not held (or last + 1), hi - lo <= 16
  local probes, p = {}, 1
  while p < last do probes[#probes + 1] = p; p = p * 2 end
  probes[#probes + 1] = last
  local lo, hi = 0, last + 1
  while #probes > 0 do
    local list = {}
    for k, i in ipairs(probes) do list[k] = string.sub(blob, 8 * i - 7, 8 * i) end
    local got = held(keys, list, 1, #list)
    for k, i in ipairs(probes) do
      if got[k] == 1 then lo = i else hi = i; break end
    end
    probes = {}
    if hi - lo > 16 then
      for k = 1, 15 do probes[k] = lo + math.floor(k * (hi - lo) / 16) end
    end
  end
  return lo, hi
end
local function leading(keys, n)  -- blocks 1..n: how many lead without a gap
  upto(n)
  for i = 1, n, CHUNK do
    local j = math.min(i + CHUNK - 1, n)
    local got = held(keys, hashes, i, j)
    for k = 1, #got do if got[k] == 0 then return i + k - 2 end end
  end
  return n
end
local function run_from(keys, a, b)  -- blocks a..b (a <= b, b - a < CHUNK): the last of the run held from a
  local list = {}
  for i = a, b do list[#list + 1] = string.sub(blob, 8 * i - 7, 8 * i) end
  local got = held(keys, list, 1, #list)
  for k = 1, #got do if got[k] == 0 then return a + k - 2 end end
  return b
end
local function probed(keys, lo, hi)  -- the bracket, trusting held blocks to form a prefix past block 16
  local head = math.min(16, hi - 1)
  if head < 1 then return 0 end
  local m = run_from(keys, 1, head)
  if m < head or hi - 1 <= 16 then return m end
  return run_from(keys, math.max(17, lo), hi - 1)
end
local out = {epoch}
for _, w in ipairs(redis.call('SMEMBERS', ns .. 'pfx:workers')) do
  local keys = {}
  for _, key in ipairs(tier_keys(w, mask)) do
    if redis.call('EXISTS', key) == 1 then keys[#keys + 1] = key end
  end
  if #keys == 0 and redis.call('EXISTS', unpack(tier_keys(w, 7))) == 0 then
    redis.call('SREM', ns .. 'pfx:workers', w)  -- its entries lapsed: stop asking for it
  end
  local matched = 0
  if #keys > 0 and last > 0 then
    local lo, hi = bracket(keys)
    if dense then matched = leading(keys, hi - 1) else matched = probed(keys, lo, hi) end
  end
  if matched > 0 then out[#out + 1] = w; out[#out + 1] = matched end
end
return out
"""


def _pack(hashes: Sequence[int]) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


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
        exact: bool = True,
    ):
        self._r = client
        self.exact = exact  # False: lookups trust held blocks to form a prefix past the first 16 (see above)
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

    async def connect(self) -> None:
        """Open a connection and load the scripts, with the bulk timeout (call once at start, so the
        first request does not pay for it within the short per-call timeout). Raises IndexUnavailable."""

        async def load():
            for script in self._scripts.values():
                script.sha = await self._r.script_load(script.script)

        await self.guard.run(load, "connect", self.bulk_timeout_s)

    async def publish(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        if hashes:
            await self._call("publish", [worker_id, _tier_name(tier), self.ttl_s, _pack(hashes)])

    async def evict(self, worker_id: str, hashes: Sequence[int], tier: Tier | None = None) -> None:
        if hashes:
            await self._call("evict", [worker_id, tier_mask(tier), self.ttl_s, _pack(hashes)])

    async def drop_worker(self, worker_id: str) -> None:
        await self._call("drop", [worker_id], self.bulk_timeout_s)

    async def snapshot(self, worker_id: str, blocks: Mapping[Tier, Sequence[int]]) -> None:
        args: list = [worker_id, self.ttl_s]
        for tier, hashes in blocks.items():
            args += [_tier_name(tier), _pack(hashes)]
        await self._call("snapshot", args, self.bulk_timeout_s)

    async def longest_prefix(self, hashes: Sequence[int], tiers: Collection[Tier] | None = None) -> dict[str, int]:
        if not hashes:
            return {}
        mask = ALL_TIERS if tiers is None else tier_mask(tiers)
        out = await self._call("longest", [mask, _pack(hashes), "1" if self.exact else "0"])
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


def _tier_name(tier: str) -> str:
    if tier not in TIER_BITS:
        raise ValueError(f"unknown tier {tier!r}; known: {sorted(TIER_BITS)}")
    return tier
