"""The Redis prefix index's previous layout, kept only so bench/prefix_lookup.py can compare it in one run.

One Redis set per worker per tier of block hashes (NS pfx:w:<worker>:<tier>, NS pfx:workers); the exact
lookup brackets each worker's match with batched SMISMEMBER probes, then checks every block up to the
bracket in one SMISMEMBER: one membership check per matched block per worker. `exact=False` checks densely
only the first 16 blocks and the bracket's last <= 16. Replaced by the per-block layout
(cache/redis_scripts.py); these scripts are verbatim from cache/redis_index.py before that change.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from cache.index import ALL_TIERS, Tier, tier_mask
from cache.redis_index import RedisPrefixIndex, _pack

# ARGV[1] = namespace, ARGV[2] = a fresh epoch token (used only if none is stored).
# Hash lists travel as one binary argument of 8-byte big-endian hashes: packing 1,000 separate
# arguments cost the client ~2-3 ms in redis-py, against one struct.pack call.
PROLOGUE = """
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
PUBLISH = PROLOGUE + """
each_chunk('SADD', ns .. 'pfx:w:' .. ARGV[3] .. ':' .. ARGV[4], ARGV[6])
touch(ARGV[3], tonumber(ARGV[5]))
return epoch
"""

# ARGV[3] = worker, ARGV[4] = tier mask, ARGV[5] = ttl, ARGV[6] = hashes
EVICT = PROLOGUE + """
for _, key in ipairs(tier_keys(ARGV[3], tonumber(ARGV[4]))) do each_chunk('SREM', key, ARGV[6]) end
touch(ARGV[3], tonumber(ARGV[5]))
return epoch
"""

# ARGV[3] = worker
DROP = PROLOGUE + """
drop(ARGV[3])
return epoch
"""

# ARGV[3] = worker, ARGV[4] = ttl, then pairs: tier name, hashes
SNAPSHOT = PROLOGUE + """
local w = ARGV[3]
drop(w)
for i = 5, #ARGV, 2 do each_chunk('SADD', ns .. 'pfx:w:' .. w .. ':' .. ARGV[i], ARGV[i + 1]) end
touch(w, tonumber(ARGV[4]))
return epoch
"""

# ARGV[3] = tier mask, ARGV[4] = hashes in prefix order, ARGV[5] = "1": dense check, "0": probes only.
# Returns {epoch, w1, n1, w2, n2, ...}
LONGEST = PROLOGUE + """
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


class SetsPrefixIndex(RedisPrefixIndex):
    """RedisPrefixIndex on the per-worker-set layout (same client, guard and epoch handling)."""

    SCRIPTS = {"publish": PUBLISH, "evict": EVICT, "drop": DROP, "snapshot": SNAPSHOT, "longest": LONGEST}

    def __init__(self, client, *, exact: bool = True, **kw):
        super().__init__(client, **kw)
        self.exact = exact

    async def longest_prefix(self, hashes: Sequence[int], tiers: Collection[Tier] | None = None) -> dict[str, int]:
        if not hashes:
            return {}
        mask = ALL_TIERS if tiers is None else tier_mask(tiers)
        out = await self._call("longest", [mask, _pack(hashes), "1" if self.exact else "0"])
        return {out[i]: int(out[i + 1]) for i in range(1, len(out), 2)}
