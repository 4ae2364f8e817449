"""Lua scripts of the Redis PrefixIndex (cache.redis_index): the per-block layout, one script per method.

Layout (P = RedisConfig.namespace + "pfx2:"; "pfx2" is the layout's version: the per-worker-set layout
used "pfx:", whose keys carry a TTL and lapse on their own after an upgrade):
- P epoch              a token written once; when it is missing, Redis lost its contents
- P slot / P owner     hashes worker -> slot and slot -> worker: a small id table (slots 0, 1, 2, ...)
- P alive:<slot>       "1" with a TTL of ttl_s, renewed by each publish/evict/snapshot of its worker: the
                       per-worker expiry. A slot without it has lapsed: lookups ignore its bits.
- P mask:<group>       hash: 8-byte block hash -> integer bit mask of which slots of the group (slots
                       10g .. 10g+9) hold that block, tier-major: bit (slot % 10) + 10 * tier (gpu 0,
                       host 1, checkpoint 2); 30 bits, so Lua's 32-bit `bit` ops hold it.
- P held:<slot>:<tier> set of the block hashes the slot holds in that tier: the reverse index that
                       snapshot, drop_worker and cleaning walk. Invariant (kept atomically by every script):
                       bit (slot, tier) is set in mask[h] iff h is in held:<slot>:<tier>, so the masks
                       are updated by adding or subtracting the bit (batched HMGET + HSET/HDEL).
- P dirty              set of retired slots (their worker lapsed or was dropped) whose entries are still
                       being cleaned; a slot is reused only once clean, so a new worker never inherits
                       stale bits.
- P snap:<slot>:<tier> staging set of a snapshot (SNAPSHOT in one script, or SNAPSHOT_PART ... SNAPSHOT_END);
                       TTL ttl_s, so a snapshot sent in parts that never ends leaves nothing behind
A lookup reads each prompt block's mask once (HMGET in growing chunks) and ANDs the live workers' bits
until every worker has dropped out: ~1 field read per matched block for all workers together, instead of
one set check per block per worker. A lapsed slot is retired by the first call that sees it, and a
dropped one by drop_worker (O(1): lookups ignore it at once); its entries are then cleaned `CLEAN_BUDGET`
per write call; when no slot is live at all, everything is unlinked at once.
Standalone Redis only: scripts touch keys they compute (no Redis Cluster).
"""
from __future__ import annotations

CLEAN_BUDGET = 1024  # retired entries forgotten per write call (~0.5 ms): bounds the time one call holds Redis

# ARGV[1] = namespace, ARGV[2] = a fresh epoch token (used only if none is stored).
# Hash lists travel as one binary argument of 8-byte big-endian hashes (one struct.pack on the client).
PROLOGUE = """
local P = ARGV[1] .. 'pfx2:'
local epoch = redis.call('GET', P .. 'epoch')
if not epoch then epoch = ARGV[2]; redis.call('SET', P .. 'epoch', epoch) end
local band, bor, bnot, rshift = bit.band, bit.bor, bit.bnot, bit.rshift
local sub = string.sub
local CHUNK, GROUP = 4000, 10  -- CHUNK: below Lua's unpack limit
local TIERS = {'gpu', 'host', 'checkpoint'}
local TIER_NO = {gpu = 0, host = 1, checkpoint = 2}
local SLOT, OWNER, DIRTY = P .. 'slot', P .. 'owner', P .. 'dirty'
local function mask_key(s) return P .. 'mask:' .. math.floor(tonumber(s) / GROUP) end
local function held_key(s, t) return P .. 'held:' .. s .. ':' .. t end
local function alive_key(s) return P .. 'alive:' .. s end
local function bit_of(s, t) return 2 ^ (tonumber(s) % GROUP + GROUP * TIER_NO[t]) end
local function split(blob, first, last)  -- hashes first..last (1-based) of a packed blob
  local out = {}
  for i = first, last do out[#out + 1] = sub(blob, 8 * i - 7, 8 * i) end
  return out
end
local function bump(s, t, hashes, sign)  -- set (sign 1) or clear (-1) (s, t)'s bit of hashes; the caller
  -- knows the bit's state from the slot's set. One HMGET and one HSET/HDEL per chunk: per-field
  -- HINCRBY calls cost ~3x as much in a script.
  local mk, b, n = mask_key(s), sign * bit_of(s, t), CHUNK / 2  -- HSET takes 2 arguments per field
  for i = 1, #hashes, n do
    local j = math.min(i + n - 1, #hashes)
    local got = redis.call('HMGET', mk, unpack(hashes, i, j))
    local set, gone = {}, {}
    for k = 1, #got do
      local h, v = hashes[i + k - 1], (tonumber(got[k]) or 0) + b
      if v == 0 then gone[#gone + 1] = h else set[#set + 1] = h; set[#set + 1] = v end
    end
    if #set > 0 then redis.call('HSET', mk, unpack(set)) end
    if #gone > 0 then redis.call('HDEL', mk, unpack(gone)) end
  end
end
local function filter(key, hashes, want)  -- the distinct hashes whose membership in key is `want`
  local out, seen = {}, {}
  for i = 1, #hashes, CHUNK do
    local j = math.min(i + CHUNK - 1, #hashes)
    local got = redis.call('SMISMEMBER', key, unpack(hashes, i, j))
    for k = 1, #got do
      local h = hashes[i + k - 1]
      if got[k] == want and not seen[h] then seen[h] = true; out[#out + 1] = h end
    end
  end
  return out
end
local function each_chunk(cmd, key, list)
  for i = 1, #list, CHUNK do redis.call(cmd, key, unpack(list, i, math.min(i + CHUNK - 1, #list))) end
end
local function add(s, t, hashes)  -- (s, t) now holds hashes
  local new, mk, b = filter(held_key(s, t), hashes, 0), mask_key(s), bit_of(s, t)
  if #new == 0 then return end
  -- A value over hash-max-listpack-value keeps the hash a hashtable: in a listpack (<= 512 small
  -- fields) every field read is a scan, ~20x slower at 512 blocks. Block fields are 8 bytes: no clash.
  redis.call('HSETNX', mk, 'layout', 'pfx2 per-block worker masks; this value is long enough to keep the hash a hashtable')
  each_chunk('SADD', held_key(s, t), new)
  bump(s, t, new, 1)
end
local function remove(s, t, hashes)  -- (s, t) no longer holds hashes (unknown ones ignored)
  local old = filter(held_key(s, t), hashes, 1)
  each_chunk('SREM', held_key(s, t), old)
  bump(s, t, old, -1)
end
local function retire(w, s)  -- hide the slot's entries now; later writes clean them before it is reused
  redis.call('HDEL', SLOT, w); redis.call('HDEL', OWNER, s); redis.call('DEL', alive_key(s))
  redis.call('SADD', DIRTY, s)
end
local function wipe(slots)  -- no slot is live: nothing stored is worth keeping
  local keys, top = {SLOT, OWNER, DIRTY}, -1
  for _, s in ipairs(slots) do
    top = math.max(top, tonumber(s))
    for _, t in ipairs(TIERS) do keys[#keys + 1] = held_key(s, t) end
  end
  for g = 0, math.floor(top / GROUP) do keys[#keys + 1] = P .. 'mask:' .. g end
  redis.call('UNLINK', unpack(keys))
end
local function live_slots()  -- {slot number -> worker}; retires lapsed slots, wipes when none is live
  local owners, live, any = redis.call('HGETALL', OWNER), {}, false
  local lapsed = {}
  for i = 1, #owners, 2 do
    local s, w = owners[i], owners[i + 1]
    if redis.call('EXISTS', alive_key(s)) == 1 then live[tonumber(s)] = w; any = true
    else lapsed[#lapsed + 1] = s; redis.call('HDEL', SLOT, w); redis.call('HDEL', OWNER, s) end
  end
  if any then
    if #lapsed > 0 then redis.call('SADD', DIRTY, unpack(lapsed)) end  -- cleaned by later writes
  elseif #owners > 0 or redis.call('EXISTS', DIRTY) == 1 then
    for _, s in ipairs(redis.call('SMEMBERS', DIRTY)) do lapsed[#lapsed + 1] = s end
    wipe(lapsed)
  end
  return live
end
local function slot_of(w, create)  -- the worker's live slot (a lapsed one is retired first), or a new one
  live_slots()
  local s = redis.call('HGET', SLOT, w)
  if s or not create then return s end
  local used = {}
  for _, x in ipairs(redis.call('HKEYS', OWNER)) do used[tonumber(x)] = true end
  for _, x in ipairs(redis.call('SMEMBERS', DIRTY)) do used[tonumber(x)] = true end
  s = 0
  while used[s] do s = s + 1 end
  redis.call('HSET', SLOT, w, s); redis.call('HSET', OWNER, s, w)
  return tostring(s)
end
local function touch(s, ttl)  -- the worker is alive: its entries live ttl more seconds
  redis.call('SET', alive_key(s), '1', 'EX', ttl)
end
local function clean(budget)  -- forget up to `budget` entries of retired slots; free a slot once clean
  for _, s in ipairs(redis.call('SMEMBERS', DIRTY)) do
    for _, t in ipairs(TIERS) do
      if budget <= 0 then return end
      local gone = redis.call('SPOP', held_key(s, t), budget)
      budget = budget - #gone
      bump(s, t, gone, -1)
    end
    if redis.call('EXISTS', held_key(s, 'gpu'), held_key(s, 'host'), held_key(s, 'checkpoint')) == 0 then
      redis.call('SREM', DIRTY, s)
    end
  end
end
"""

CLEAN = f"clean({CLEAN_BUDGET})\n"

# ARGV[3] = worker, ARGV[4] = tier name, ARGV[5] = ttl, ARGV[6] = hashes
PUBLISH = PROLOGUE + """
local s = slot_of(ARGV[3], true)
add(s, ARGV[4], split(ARGV[6], 1, #ARGV[6] / 8))
touch(s, tonumber(ARGV[5]))
""" + CLEAN + "return epoch\n"

# ARGV[3] = worker, ARGV[4] = tier mask, ARGV[5] = ttl, ARGV[6] = hashes
EVICT = PROLOGUE + """
local s = slot_of(ARGV[3], false)
if s then
  local hashes, mask = split(ARGV[6], 1, #ARGV[6] / 8), tonumber(ARGV[4])
  for i, t in ipairs(TIERS) do
    if band(mask, 2 ^ (i - 1)) ~= 0 then remove(s, t, hashes) end
  end
  touch(s, tonumber(ARGV[5]))
end
""" + CLEAN + "return epoch\n"

# ARGV[3] = worker. Lookups stop seeing its entries at once; they are cleaned like a lapsed worker's, so
# dropping 100k blocks does not hold Redis (and every lookup behind it) for ~100 ms.
DROP = PROLOGUE + """
local s = slot_of(ARGV[3], false)
if s then retire(ARGV[3], s) end
""" + CLEAN + "return epoch\n"

# Snapshots replace a worker's entries, per tier. Each hash given is added at once (lookups see it) and staged;
# the end removes what is held and was not staged (a set difference in C; skipped when nothing was dropped)
# and empties a tier no hash was given for. Small snapshots do both in one script (SNAPSHOT); large ones go
# in parts (SNAPSHOT_PART, then SNAPSHOT_END), so no single script holds Redis for long: a first 100k-block
# snapshot in one call held it ~200 ms, and every lookup behind it timed out.
# Every snapshot script: ARGV[3] = worker, ARGV[4] = ttl; SNAPSHOT and SNAPSHOT_PART also ARGV[5] = "1" on a
# snapshot's first part (clears a failed one's staging), then pairs: tier name, hashes.
SNAPSHOT_FNS = """
local function stage_key(s, t) return P .. 'snap:' .. s .. ':' .. t end
local function given()  -- whether the pairs hold any hash
  for i = 7, #ARGV, 2 do if #ARGV[i] > 0 then return true end end
  return false
end
local function stage(s)
  if ARGV[5] == '1' then
    for _, t in ipairs(TIERS) do redis.call('UNLINK', stage_key(s, t)) end
  end
  for i = 6, #ARGV, 2 do
    if #ARGV[i + 1] > 0 then
      local hashes = split(ARGV[i + 1], 1, #ARGV[i + 1] / 8)
      add(s, ARGV[i], hashes)
      each_chunk('SADD', stage_key(s, ARGV[i]), hashes)
      redis.call('EXPIRE', stage_key(s, ARGV[i]), tonumber(ARGV[4]))
    end
  end
end
local function finish(w, s)
  local any = false
  for _, t in ipairs(TIERS) do
    local key, staged = held_key(s, t), stage_key(s, t)
    local gone
    if redis.call('EXISTS', staged) == 1 then
      any = true
      -- everything staged was added, so staged is a subset of held: equal sizes mean nothing to remove
      -- (the periodic snapshot of an unchanged worker), and the O(held) difference is skipped
      if redis.call('SCARD', key) == redis.call('SCARD', staged) then gone = {}
      else gone = redis.call('SDIFF', key, staged) end
      each_chunk('SREM', key, gone)
      redis.call('UNLINK', staged)  -- freed off Redis's main thread: a 100k-member set takes ~10 ms to free
    else
      gone = redis.call('SMEMBERS', key)
      redis.call('DEL', key)
    end
    bump(s, t, gone, -1)
  end
  if any then touch(s, tonumber(ARGV[4])) else retire(w, s) end
end
"""

SNAPSHOT = PROLOGUE + SNAPSHOT_FNS + """
local s = slot_of(ARGV[3], given())
if s then
  stage(s)
  finish(ARGV[3], s)
end
""" + CLEAN + "return epoch\n"

SNAPSHOT_PART = PROLOGUE + SNAPSHOT_FNS + """
local s = slot_of(ARGV[3], true)
stage(s)
touch(s, tonumber(ARGV[4]))
""" + CLEAN + "return epoch\n"

SNAPSHOT_END = PROLOGUE + SNAPSHOT_FNS + """
local s = slot_of(ARGV[3], false)
if s then finish(ARGV[3], s) end
""" + CLEAN + "return epoch\n"

# ARGV[3] = tier mask, ARGV[4] = hashes in prefix order. Returns {epoch, w1, n1, w2, n2, ...}.
LONGEST = PROLOGUE + """
local tiers, blob = tonumber(ARGV[3]), ARGV[4]
local last = #blob / 8
local sel = 0  -- the selected tiers' bit ranges of a mask
for i = 1, 3 do
  if band(tiers, 2 ^ (i - 1)) ~= 0 then sel = bor(sel, 1023 * 2 ^ (GROUP * (i - 1))) end
end
local groups = {}  -- group -> bits of its live slots
local live = live_slots()
for s, _ in pairs(live) do
  local g = math.floor(s / GROUP)
  groups[g] = bor(groups[g] or 0, 2 ^ (s % GROUP))
end
local hashes = {}  -- split lazily: only as deep as some worker matches
local out = {epoch}
local function ended(g, bits, matched)  -- the workers of `bits` matched `matched` blocks
  if matched == 0 then return end
  for b = 0, GROUP - 1 do
    if band(bits, 2 ^ b) ~= 0 then out[#out + 1] = live[g * GROUP + b]; out[#out + 1] = matched end
  end
end
for g, cur in pairs(groups) do
  local key, prev, i, size = P .. 'mask:' .. g, nil, 1, 64
  while cur ~= 0 and i <= last do
    local j = math.min(i + size - 1, last)
    if j > #hashes then
      for k = #hashes + 1, j do hashes[k] = sub(blob, 8 * k - 7, 8 * k) end
    end
    local got = redis.call('HMGET', key, unpack(hashes, i, j))
    for k = 1, #got do
      local v = got[k]
      if v ~= prev then  -- masks repeat along a prompt (Lua strings compare by identity): only a change drops workers
        prev = v
        local here = 0
        if v then
          local m = band(tonumber(v), sel)
          here = band(bor(m, rshift(m, GROUP), rshift(m, 2 * GROUP)), 1023)  -- held in any selected tier
        end
        local gone = band(cur, bnot(here))
        if gone ~= 0 then
          ended(g, gone, i + k - 2)
          cur = band(cur, here)
          if cur == 0 then break end
        end
      end
    end
    i, size = j + 1, math.min(size * 2, CHUNK)
  end
  if cur ~= 0 then ended(g, cur, last) end
end
return out
"""
