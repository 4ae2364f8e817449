"""A big worker's snapshot into the Redis prefix index, and what lookups feel meanwhile.

A worker re-sends everything it holds as a snapshot at start, every ttl/3 and after Redis comes back.
Redis runs one script at a time, so a snapshot in one script holds every gateway's lookup behind it.
Configurations, interleaved per bench/protocol.py, each on its own namespace of one real redis-server
started here:
- one_call: the whole snapshot as one script (what every snapshot did before session 4);
- parts:    RedisPrefixIndex's default: parts of `snapshot_part` (2,048) hashes, then an end script.
Per repeat and configuration: a worker's first snapshot of `--blocks` blocks (nothing held yet), then the
same snapshot again (the periodic case: nothing changed). Meanwhile a second client looks up a 1,024-block
prompt in a loop (the gateways' side). Metrics: each snapshot's total ms, the longest single call to Redis
within it (ms), and the lookups' max and p99 latency while it ran (ms).

    python -m bench.redis_snapshot --repeats 5 --warmup 1
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench import protocol
from bench.machine import machine_info
from bench.redis_run import bench_redis
from cache.hashing import chain_hashes
from cache.redis_guard import make_client
from cache.redis_index import RedisPrefixIndex
from tests.conftest_redis import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {"one_call": 10**9, "parts": 2048}
METRICS = ["first_ms", "first_longest_call_ms", "first_lookup_max_ms", "first_lookup_p99_ms",
           "again_ms", "again_longest_call_ms", "again_lookup_max_ms"]


class CallTimer:
    """Wraps RedisPrefixIndex._call to record each call's duration (one script, one round trip)."""

    def __init__(self, index: RedisPrefixIndex):
        self.calls: list[float] = []
        inner = index._call

        async def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return await inner(*args, **kw)
            finally:
                self.calls.append(time.perf_counter() - t0)

        index._call = timed


async def snapshot_with_lookups(index, timer, looker, hashes, prompt) -> dict:
    lat: list[float] = []
    done = asyncio.Event()

    async def look():
        while not done.is_set():
            t0 = time.perf_counter()
            await looker.longest_prefix(prompt)
            lat.append(time.perf_counter() - t0)

    task = asyncio.create_task(look())
    await asyncio.sleep(0.01)  # the lookups are running before the snapshot starts
    timer.calls.clear()
    t0 = time.perf_counter()
    await index.snapshot("big", {"gpu": hashes})
    total = time.perf_counter() - t0
    done.set()
    await task
    lat.sort()
    return {"ms": 1e3 * total, "longest_call_ms": 1e3 * max(timer.calls),
            "lookup_max_ms": 1e3 * lat[-1], "lookup_p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def measures(server: RedisServer, blocks: int, closers: list) -> dict:
    hashes = chain_hashes(list(range(16 * blocks)), 16)
    prompt = chain_hashes(list(range(10**6, 10**6 + 16 * 1024)), 16)
    counter = iter(range(10**9))
    out = {}
    for name, part in CONFIGS.items():
        async def measure(name=name, part=part):
            ns = f"{name}{next(counter)}:"
            index = RedisPrefixIndex(make_client(server.url, 10.0), namespace=ns, timeout_s=10.0,
                                     bulk_timeout_s=30.0, snapshot_part=part)
            looker = RedisPrefixIndex(make_client(server.url, 10.0), namespace=ns, timeout_s=10.0)
            closers.extend([index, looker])
            await looker.publish("other", prompt)  # the looked-up prompt is held by another worker
            timer = CallTimer(index)
            first = await snapshot_with_lookups(index, timer, looker, hashes, prompt)
            again = await snapshot_with_lookups(index, timer, looker, hashes, prompt)
            await index.drop_worker("big")
            return {"first_ms": first["ms"], "first_longest_call_ms": first["longest_call_ms"],
                    "first_lookup_max_ms": first["lookup_max_ms"], "first_lookup_p99_ms": first["lookup_p99_ms"],
                    "again_ms": again["ms"], "again_longest_call_ms": again["longest_call_ms"],
                    "again_lookup_max_ms": again["lookup_max_ms"]}

        out[name] = measure
    return out


async def main_async(args) -> int:
    machine = machine_info()
    started, closers = time.time(), []
    with bench_redis() as server:
        records = await protocol.run(measures(server, args.blocks, closers), args.repeats, args.warmup,
                                     progress=not args.quiet)
        for c in closers:
            await c.close()
    summary = protocol.summarize(records)
    doc = protocol.result_document("redis_snapshot", records, summary, {"blocks": args.blocks}, started, machine)
    table = protocol.markdown_table(summary, METRICS, digits=1)
    paths = protocol.write_result(doc, table, ["first_lookup_max_ms", "again_lookup_max_ms"], args.out)
    print(table)
    print(f"\nwritten: {paths['md']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    protocol.add_arguments(ap, RESULTS)
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks the worker holds (100k: 1.6M tokens)")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
