"""The router's per-request cost before the first token: hash the prompt, look up the prefix index, decide.

Configurations (interleaved per bench/protocol.py), each timing `--calls` calls in one repeat:
- hash@T:          cache.hashing.chain_hashes over a T-token prompt (block 16)
- memory@B/W:      MemoryPrefixIndex.longest_prefix, B-block prompt, W workers holding 1/W .. W/W of it
- redis@B/W:       RedisPrefixIndex.longest_prefix (per-block masks, cache/redis_scripts.py) against a real
                   redis-server started here (one round trip)
- redis-sets@B/W:  the previous layout (one set per worker per tier, bench/prefix_lookup_sets.py), exact:
                   one membership check per matched block per worker; kept to compare with in one run
- redis-sets-probe@B/W: the previous layout with exact=False (probes, dense checks of only the first 16
                   blocks and the bracket's last <= 16)
- <layout>-republish@1024/8: the deepest worker publishes its 1,024 held blocks again (what the
                   llama-server backend does per request): the write cost of each layout, 16k x 8 only
- decide@W:        policy.routing.choose_worker with W workers and prefix hits
Metrics: p50/p99 µs per call; for redis also Redis's own time per call (INFO commandstats, µs).
After the run: Redis memory per layout and shape (MEMORY USAGE summed over each namespace's keys).
Goal (issue 6): router decision time p99 <= 1 ms.

    python -m bench.prefix_lookup --repeats 5 --warmup 2
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench import protocol
from bench.machine import machine_info
from bench.prefix_lookup_sets import SetsPrefixIndex
from bench.redis_run import bench_redis
from cache.hashing import chain_hashes
from cache.memory_index import MemoryPrefixIndex
from cache.redis_guard import make_client
from cache.redis_index import RedisPrefixIndex
from policy.config import RoutingConfig
from policy.routing import choose_worker
from policy.types import RouteRequest, WorkerLoad
from tests.conftest_redis import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
# (prompt blocks, workers): 1k, 8k, 16k tokens; 16 workers fill two 10-slot groups of the per-block layout
SHAPES = [(64, 4), (512, 4), (1024, 8), (1024, 16)]
METRICS = ["p50_us", "p99_us", "redis_server_us"]
LAYOUTS = {  # config prefix -> (namespace prefix, index factory)
    "redis": ("b", lambda client, ns: RedisPrefixIndex(client, namespace=ns, timeout_s=1.0)),
    "redis-sets": ("s", lambda client, ns: SetsPrefixIndex(client, namespace=ns, timeout_s=1.0)),
    "redis-sets-probe": ("p", lambda client, ns: SetsPrefixIndex(client, namespace=ns, timeout_s=1.0, exact=False)),
}


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
        mem, state = MemoryPrefixIndex(), {}

        async def mem_measure(mem=mem, blocks=blocks, workers=workers, state=state):
            state.setdefault("mh", await fill(mem, blocks, workers))
            return await timed(lambda: mem.longest_prefix(state["mh"]), calls)

        out[f"memory@{blocks}/{workers}"] = mem_measure
        for name, (prefix, make) in LAYOUTS.items():
            index = make(make_client(server.url, 1.0), f"{prefix}{blocks}x{workers}:")
            closers.append(index)
            out[f"{name}@{blocks}/{workers}"] = redis_measure(index, blocks, workers, calls, server)
            if (blocks, workers) == (1024, 8) and name != "redis-sets-probe":  # same writes as redis-sets
                index = make(make_client(server.url, 1.0), f"{prefix}{blocks}x{workers}u:")
                closers.append(index)
                out[f"{name}-republish@{blocks}/{workers}"] = redis_measure(index, blocks, workers, calls, server,
                                                                            republish=True)
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


def redis_measure(red: RedisPrefixIndex, blocks: int, workers: int, calls: int, server: RedisServer,
                  republish: bool = False):
    """Fill once (first call), then time lookups (or the last worker publishing its blocks again); Redis's
    own time per call from INFO commandstats."""
    state: dict = {}

    async def measure():
        if "h" not in state:
            await red.connect()
            state["h"] = await fill(red, blocks, workers)
            assert await red.longest_prefix(state["h"]) == {
                f"w{w}": blocks * (w + 1) // workers for w in range(workers)}, "wrong lookup answer"
        side = make_client(server.url, 1.0)
        await side.config_resetstat()
        if republish:
            m = await timed(lambda: red.publish(f"w{workers - 1}", state["h"]), calls)
        else:
            m = await timed(lambda: red.longest_prefix(state["h"]), calls)
        m["redis_server_us"] = (await side.info("commandstats"))["cmdstat_evalsha"]["usec_per_call"]
        await side.aclose()
        return m

    return measure


async def memory_by_namespace(url: str) -> dict[str, int]:
    """Bytes Redis holds per layout and shape (MEMORY USAGE of every key, all elements counted)."""
    side, out = make_client(url, 5.0), {}
    try:
        for name, (prefix, _) in LAYOUTS.items():
            for blocks, workers in SHAPES:
                total = 0
                async for key in side.scan_iter(match=f"{prefix}{blocks}x{workers}:*", count=1000):
                    total += await side.memory_usage(key, samples=0) or 0
                out[f"{name}@{blocks}/{workers}"] = total
    finally:
        await side.aclose()
    return out


async def main_async(args) -> int:
    machine = machine_info()
    started = time.time()
    with bench_redis() as server:
        ms, closers = measures(server, args.calls)
        records = await protocol.run(ms, args.repeats, args.warmup, progress=not args.quiet)
        memory = await memory_by_namespace(server.url)
        for c in closers:
            await c.close()
    summary = protocol.summarize(records)
    doc = protocol.result_document("prefix_lookup", records, summary, {"calls": args.calls, "shapes": SHAPES},
                                   started, machine)
    doc["redis_memory_bytes"] = memory
    table = protocol.markdown_table(summary, METRICS, digits=0)
    paths = protocol.write_result(doc, table, ["p50_us", "p99_us"], args.out)
    print(table)
    print("\nRedis memory (MEMORY USAGE, bytes): " + ", ".join(f"{k} {v:,}" for k, v in memory.items()))
    print(f"\nwritten: {paths['md']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    protocol.add_arguments(ap, RESULTS)
    ap.add_argument("--calls", type=int, default=300, help="calls timed per configuration and repeat")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
