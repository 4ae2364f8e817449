"""The router's per-request cost before the first token: hash the prompt, look up the prefix index, decide.

Configurations (interleaved per bench/protocol.py), each timing `--calls` calls in one repeat:
- hash@T:          cache.hashing.chain_hashes over a T-token prompt (block 16)
- memory@B/W:      MemoryPrefixIndex.longest_prefix, B-block prompt, W workers holding 1/W .. W/W of it
- redis@B/W:       RedisPrefixIndex.longest_prefix against a real redis-server started here (one round trip)
- redis-probe@B/W: RedisPrefixIndex(exact=False): probes, and dense checks of only the first 16 blocks and
                   the bracket's last <= 16 (trusts held blocks past the 16th to form a prefix)
- redis-chunks@B/W: the exact lookup before the bracketing probes (growing dense chunks of 16, 64, 256, ...
                   blocks per worker; kept here only to compare with it in one run)
- decide@W:        policy.routing.choose_worker with W workers and prefix hits
Metrics: p50/p99 µs per call; for redis also Redis's own time per call (INFO commandstats, µs).
Goal (issue 6): router decision time p99 <= 1 ms.

    python -m bench.prefix_lookup --repeats 5 --warmup 2
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from pathlib import Path

from bench import protocol
from bench.machine import machine_info
from cache.hashing import chain_hashes
from cache.memory_index import MemoryPrefixIndex
from cache.redis_guard import make_client
from cache.redis_index import _PROLOGUE, RedisPrefixIndex
from policy.config import RoutingConfig
from policy.routing import choose_worker
from policy.types import RouteRequest, WorkerLoad
from tests.conftest_redis import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(64, 4), (512, 4), (1024, 8)]  # (prompt blocks, workers): 1k, 8k, 16k tokens
METRICS = ["p50_us", "p99_us", "redis_server_us"]

# The lookup script before commit "redis index: bracket each worker's match with batched probes".
_LONGEST_CHUNKS = _PROLOGUE + """
local mask, blob = tonumber(ARGV[3]), ARGV[4]
local last = #blob / 8
local hashes = {}  -- split lazily: only as deep as some worker matches
local function upto(j)
  if j > #hashes then
    for _, h in ipairs(split(blob, #hashes + 1, j)) do hashes[#hashes + 1] = h end
  end
end
local function held(keys, i, j)  -- per block i..j: held in any of keys? (1 or 0)
  upto(j)
  local got = redis.call('SMISMEMBER', keys[1], unpack(hashes, i, j))
  for t = 2, #keys do
    local more = redis.call('SMISMEMBER', keys[t], unpack(hashes, i, j))
    for k = 1, #got do if more[k] == 1 then got[k] = 1 end end
  end
  return got
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
  local matched, i, size, open = 0, 1, 16, #keys > 0
  while open and i <= last do
    local j = math.min(i + size - 1, last)
    local got = held(keys, i, j)
    for k = 1, #got do
      if got[k] == 0 then open = false; break end
      matched = matched + 1
    end
    i, size = j + 1, math.min(size * 4, CHUNK)
  end
  if matched > 0 then out[#out + 1] = w; out[#out + 1] = matched end
end
return out
"""


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


async def timed(call, calls: int) -> dict:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - t0) * 1e6)
    return {"p50_us": pct(samples, 0.5), "p99_us": pct(samples, 0.99)}


async def fill(index, blocks: int, workers: int) -> list[int]:
    hashes = chain_hashes(list(range(16 * blocks)), 16)
    for w in range(workers):
        await index.publish(f"w{w}", hashes[: blocks * (w + 1) // workers])
    return hashes


def measures(server: RedisServer, calls: int) -> tuple[dict, list]:
    out, closers = {}, []
    for tokens in (1024, 8192, 16384):
        ids = list(range(tokens))

        async def hash_call(ids=ids):
            chain_hashes(ids, 16)

        out[f"hash@{tokens}"] = lambda c=hash_call: timed(c, calls)
    for blocks, workers in SHAPES:
        mem, red = MemoryPrefixIndex(), RedisPrefixIndex(make_client(server.url, 1.0), namespace=f"b{blocks}:",
                                                         timeout_s=1.0)
        closers.append(red)
        state = {}
        out.update(redis_variants(server, blocks, workers, calls, closers))

        async def mem_measure(mem=mem, blocks=blocks, workers=workers, state=state):
            state.setdefault("mh", await fill(mem, blocks, workers))
            return await timed(lambda: mem.longest_prefix(state["mh"]), calls)

        async def redis_measure(red=red, blocks=blocks, workers=workers, state=state):
            if "rh" not in state:
                await red.connect()
                state["rh"] = await fill(red, blocks, workers)
            side = make_client(server.url, 1.0)
            await side.config_resetstat()
            m = await timed(lambda: red.longest_prefix(state["rh"]), calls)
            m["redis_server_us"] = (await side.info("commandstats"))["cmdstat_evalsha"]["usec_per_call"]
            await side.aclose()
            return m

        out[f"memory@{blocks}/{workers}"] = mem_measure
        out[f"redis@{blocks}/{workers}"] = redis_measure
    for workers in (4, 8):
        loads = [WorkerLoad(f"w{i}", running=i % 5, waiting=i % 3, slots=4, kv_blocks_total=1000,
                            kv_blocks_used=100 * i) for i in range(workers)]
        hits = {"w1": 40, "w3": 80}
        cfg = RoutingConfig()
        seq = iter(range(10**9))

        async def decide(loads=loads, hits=hits, cfg=cfg, seq=seq):
            n = next(seq)
            choose_worker(loads, hits, RouteRequest(4000, 64, session_id=f"s{n % 50}", seq=n), cfg)

        out[f"decide@{workers}"] = lambda d=decide: timed(d, calls)
    return out, closers


def redis_variants(server: RedisServer, blocks: int, workers: int, calls: int, closers: list) -> dict:
    """redis-probe@B/W (exact=False) and redis-chunks@B/W (the previous exact script), same server and shape."""
    probe = RedisPrefixIndex(make_client(server.url, 1.0), namespace=f"p{blocks}:", timeout_s=1.0, exact=False)
    chunks = RedisPrefixIndex(make_client(server.url, 1.0), namespace=f"c{blocks}:", timeout_s=1.0)
    chunks._scripts["longest"] = chunks._r.register_script(_LONGEST_CHUNKS)
    return {f"redis-probe@{blocks}/{workers}": redis_measure(probe, blocks, workers, calls, closers, server),
            f"redis-chunks@{blocks}/{workers}": redis_measure(chunks, blocks, workers, calls, closers, server)}


def redis_measure(red: RedisPrefixIndex, blocks: int, workers: int, calls: int, closers: list, server):
    closers.append(red)
    state: dict = {}

    async def measure():
        if "h" not in state:
            await red.connect()
            state["h"] = await fill(red, blocks, workers)
        side = make_client(server.url, 1.0)
        await side.config_resetstat()
        m = await timed(lambda: red.longest_prefix(state["h"]), calls)
        m["redis_server_us"] = (await side.info("commandstats"))["cmdstat_evalsha"]["usec_per_call"]
        await side.aclose()
        return m

    return measure


async def main_async(args) -> int:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    machine = machine_info()
    server = RedisServer(binary)
    server.start()
    started = time.time()
    try:
        ms, closers = measures(server, args.calls)
        records = await protocol.run(ms, args.repeats, args.warmup, progress=not args.quiet)
        for c in closers:
            await c.close()
    finally:
        server.close()
    summary = protocol.summarize(records)
    doc = protocol.result_document("prefix_lookup", records, summary, {"calls": args.calls, "shapes": SHAPES},
                                   started, machine)
    table = protocol.markdown_table(summary, METRICS, digits=0)
    paths = protocol.write_result(doc, table, ["p50_us", "p99_us"], args.out)
    print(table)
    print(f"\nwritten: {paths['md']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    protocol.add_arguments(ap, RESULTS)
    ap.add_argument("--calls", type=int, default=300, help="calls timed per configuration and repeat")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
