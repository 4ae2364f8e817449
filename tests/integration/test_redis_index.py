"""The PrefixIndex contract against both implementations, and Redis failure handling, with a real redis-server."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from cache.hashing import chain_hashes
from cache.index import IndexUnavailable
from cache.memory_index import MemoryPrefixIndex
from cache.redis_guard import make_client
from cache.redis_index import RedisPrefixIndex
from tests.conftest_redis import redis_server  # noqa: F401  (fixture)

H = chain_hashes(list(range(16 * 8)), 16)  # 8 chained block hashes
OTHER = chain_hashes([7] * 64, 16)


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["memory", "redis"])
async def index(request):
    if request.param == "memory":
        yield MemoryPrefixIndex(ttl_s=60)
        return
    server = request.getfixturevalue("redis_server")
    idx = RedisPrefixIndex(make_client(server.url, 0.5), namespace="t:", ttl_s=60, timeout_s=0.5)
    yield idx
    await idx.close()


async def test_round_trip_several_workers(index):
    await index.publish("w1", H[:5])
    await index.publish("w2", H[:3])
    await index.publish("w3", H[:1], "checkpoint")
    assert await index.longest_prefix(H) == {"w1": 5, "w2": 3, "w3": 1}
    assert await index.longest_prefix(H[:2]) == {"w1": 2, "w2": 2, "w3": 1}
    assert await index.longest_prefix(OTHER) == {}
    assert await index.longest_prefix([]) == {}


async def test_a_gap_ends_the_prefix(index):
    await index.publish("w", [H[0], H[1], H[3], H[4]])
    assert await index.longest_prefix(H) == {"w": 2}
    assert await index.longest_prefix(H[3:]) == {"w": 2}  # a suffix chain on its own is still a chain


async def test_evict_and_drop_worker(index):
    await index.publish("w1", H)
    await index.publish("w2", H)
    await index.evict("w1", [H[3]])
    await index.evict("w1", [OTHER[0]])  # unknown: ignored
    assert await index.longest_prefix(H) == {"w1": 3, "w2": 8}
    await index.drop_worker("w2")
    assert await index.longest_prefix(H) == {"w1": 3}
    await index.drop_worker("nobody")


async def test_tiers(index):
    await index.publish("w", H[:4], "gpu")
    await index.publish("w", H, "checkpoint")
    assert await index.longest_prefix(H) == {"w": 8}
    assert await index.longest_prefix(H, tiers=["gpu"]) == {"w": 4}
    assert await index.longest_prefix(H, tiers=["host"]) == {}
    await index.evict("w", H[:1], "gpu")  # the GPU copy went; the checkpoint remains
    assert await index.longest_prefix(H, tiers=["gpu"]) == {}
    assert await index.longest_prefix(H) == {"w": 8}
    await index.evict("w", H[:1])  # every tier
    assert await index.longest_prefix(H) == {}
    with pytest.raises(ValueError):
        await index.publish("w", H, "disk")


async def test_snapshot_replaces_a_workers_entries(index):
    await index.publish("w", H)
    await index.publish("v", H[:2])
    await index.snapshot("w", {"gpu": H[:2], "checkpoint": H[:6]})
    assert await index.longest_prefix(H) == {"w": 6, "v": 2}
    assert await index.longest_prefix(H, tiers=["gpu"]) == {"w": 2, "v": 2}
    await index.snapshot("w", {})
    assert await index.longest_prefix(H) == {"v": 2}


async def test_apply_block_events(index):
    await index.apply("w", "added", H[:4], "gpu")
    await index.apply("w", "evicted", H[2:4], "gpu")
    assert await index.longest_prefix(H) == {"w": 2}
    with pytest.raises(ValueError):
        await index.apply("w", "moved", H)


async def test_memory_expiry_is_a_safety_net():
    clock = Clock()
    index = MemoryPrefixIndex(ttl_s=10, clock=clock)
    await index.publish("w", H)
    await index.publish("v", H[:3])
    clock.t += 5
    await index.publish("w", H[:2])  # w is alive: all its entries live 10 s from now
    clock.t += 6
    assert await index.longest_prefix(H) == {"w": 8}  # v went silent: lapsed
    await index.publish("v", H[3:4])  # lapsed entries do not come back with a new publish
    assert await index.longest_prefix(H) == {"w": 8}
    clock.t += 11
    assert await index.longest_prefix(H) == {}
    assert sorted(index.sweep()) == ["v", "w"] and len(index) == 0


@pytest.mark.slow
async def test_redis_expiry_is_a_safety_net(redis_server):
    index = RedisPrefixIndex(make_client(redis_server.url, 0.5), namespace="t:", ttl_s=1, timeout_s=0.5)
    try:
        await index.publish("w", H)
        await index.publish("v", H[:2])
        await asyncio.sleep(0.6)
        await index.evict("w", [OTHER[0]])  # any sign of life from w renews its entries
        await asyncio.sleep(0.6)
        assert await index.longest_prefix(H) == {"w": 8}
        await asyncio.sleep(0.6)
        assert await index.longest_prefix(H) == {}
        # the keys themselves are gone too, and lookups prune the workers set
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        assert sorted(await r.keys("t:*")) == ["t:pfx2:epoch"]
        await r.aclose()
    finally:
        await index.close()


async def command_calls(r: aioredis.Redis) -> dict[str, int]:
    stats = await r.info("commandstats")
    return {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}


async def test_longest_prefix_is_one_round_trip_for_many_workers(redis_server):
    index = RedisPrefixIndex(make_client(redis_server.url, 0.5), namespace="t:", timeout_s=0.5)
    side = aioredis.Redis.from_url(redis_server.url)
    try:
        long = chain_hashes(list(range(16 * 512)), 16)  # an 8k-token prompt: 512 blocks
        for n, w in enumerate(["w0", "w1", "w2", "w3", "w4", "w5"]):
            await index.publish(w, long[: 64 * (n + 1)])
        assert await index.longest_prefix(long) == {f"w{n}": 64 * (n + 1) for n in range(6)}
        before = await command_calls(side)
        await index.longest_prefix(long)
        after = await command_calls(side)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        # One EVALSHA from the client (INFO is the side client's read); the block reads ran inside it.
        moved = {k: v for k, v in delta.items() if v and k not in ("hmget", "hgetall", "exists", "get", "info")}
        assert moved == {"evalsha": 1}
        # The six workers share one mask walk: HMGET chunks of 64, 128, 256 blocks, until the deepest (384
        # held) drops out; no per-worker reads at all.
        assert delta["hmget"] == 3
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            await index.longest_prefix(long)
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"longest_prefix 512 blocks x 6 workers: median {times[25] * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms")
    finally:
        await side.aclose()
        await index.close()


async def test_gateways_share_one_view(redis_server):
    a = RedisPrefixIndex(make_client(redis_server.url, 0.5), namespace="t:", timeout_s=0.5)
    b = RedisPrefixIndex(make_client(redis_server.url, 0.5), namespace="t:", timeout_s=0.5)
    other_ns = RedisPrefixIndex(make_client(redis_server.url, 0.5), namespace="u:", timeout_s=0.5)
    try:
        await a.publish("w", H[:3])
        assert await b.longest_prefix(H) == {"w": 3}
        assert await other_ns.longest_prefix(H) == {}
    finally:
        for idx in (a, b, other_ns):
            await idx.close()


# ---- Redis down, slow, restarted -----------------------------------------------------------------


class Recovered:
    def __init__(self):
        self.calls = 0

    async def __call__(self):
        self.calls += 1


async def test_redis_stopped_fails_fast_then_refills_after_restart(redis_server):
    recovered = Recovered()
    index = RedisPrefixIndex(
        make_client(redis_server.url, 0.2), namespace="t:", timeout_s=0.2, retry_interval_s=0.3,
        on_recovered=recovered,
    )
    try:
        await index.connect()
        await index.publish("w", H)
        assert await index.longest_prefix(H) == {"w": 8}
        redis_server.stop()
        t0 = time.perf_counter()
        with pytest.raises(IndexUnavailable):
            await index.longest_prefix(H)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        with pytest.raises(IndexUnavailable, match="within the last"):
            await index.longest_prefix(H)  # circuit open: no network at all
        second = time.perf_counter() - t0
        # generous bounds for a loaded shared box; the point: no OS-level connect/read timeouts (seconds)
        assert first < 1.0 and second < 0.05, (first, second)
        assert not index.available
        with pytest.raises(IndexUnavailable):
            await index.publish("w", H)  # a publisher sees the same error and keeps serving
        redis_server.start()  # back, empty: no persistence
        await asyncio.sleep(0.35)
        assert await index.longest_prefix(H) == {}  # answered again; the entries are gone...
        await asyncio.sleep(0)  # ...and the refill callback ran (once)
        assert recovered.calls == 1
        await index.snapshot("w", {"gpu": H[:6]})  # what a worker does when asked to refill
        assert await index.longest_prefix(H) == {"w": 6}
        assert recovered.calls == 1
    finally:
        await index.close()


async def test_redis_paused_times_out_at_the_configured_timeout(redis_server):
    index = RedisPrefixIndex(make_client(redis_server.url, 0.2), namespace="t:", timeout_s=0.2, retry_interval_s=0.2)
    try:
        await index.connect()
        await index.publish("w", H)
        redis_server.pause()  # a Redis that accepts nothing and answers nothing
        t0 = time.perf_counter()
        with pytest.raises(IndexUnavailable):
            await index.longest_prefix(H)
        assert 0.19 < time.perf_counter() - t0 < 1.0  # the configured timeout, not the OS's
        redis_server.resume()
        await asyncio.sleep(0.25)
        assert await index.longest_prefix(H) == {"w": 8}  # same Redis, contents kept
    finally:
        redis_server.resume()
        await index.close()


async def test_after_a_failure_one_call_tries_redis_and_the_others_fail_fast(redis_server):
    """Past the open circuit one call (the probe) waits on a frozen Redis; calls arriving meanwhile fail at once
    rather than each waiting out the timeout too (RELIABILITY.md: a frozen Redis had held every client's key check
    for its 1 s once a retry interval), and once a probe finds Redis answering again every call goes through."""
    index = RedisPrefixIndex(make_client(redis_server.url, 0.4), namespace="t:", timeout_s=0.4, retry_interval_s=0.2)
    try:
        await index.connect()
        await index.publish("w", H)
        redis_server.pause()
        with pytest.raises(IndexUnavailable):
            await index.longest_prefix(H)  # trips the circuit
        await asyncio.sleep(0.25)  # past the retry interval
        probe = asyncio.ensure_future(index.longest_prefix(H))
        await asyncio.sleep(0.05)  # the probe is waiting on the frozen Redis
        t0 = time.perf_counter()
        for _ in range(5):
            with pytest.raises(IndexUnavailable, match="another call is trying"):
                await index.longest_prefix(H)
        assert time.perf_counter() - t0 < 0.1
        with pytest.raises(IndexUnavailable):
            await probe  # its own timeout
        redis_server.resume()
        await asyncio.sleep(0.25)
        assert await index.longest_prefix(H) == {"w": 8}  # the next probe finds it back...
        assert await asyncio.gather(*(index.longest_prefix(H) for _ in range(3))) == [{"w": 8}] * 3  # ...for all
    finally:
        redis_server.resume()
        await index.close()


async def test_a_restart_between_calls_is_noticed(redis_server):
    """Redis lost its contents without any call failing (e.g. another client flushed it): refill anyway."""
    recovered = Recovered()
    index = RedisPrefixIndex(make_client(redis_server.url, 0.5), namespace="t:", timeout_s=0.5, on_recovered=recovered)
    side = aioredis.Redis.from_url(redis_server.url)
    try:
        await index.publish("w", H)
        await side.flushall()
        assert await index.longest_prefix(H) == {}
        await asyncio.sleep(0)
        assert recovered.calls == 1
    finally:
        await side.aclose()
        await index.close()


LONG = chain_hashes(list(range(16 * 700)), 16)  # 700 blocks: several HMGET chunks


async def test_redis_lookup_is_exact_for_any_held_set(redis_server):
    """The Redis lookup's answer must equal the in-process index's (the first gap) for prefixes, gaps at
    and next to chunk edges (64, 192, 448), several tiers, and sets that are not prefixes at all."""
    import random

    rng = random.Random(7)
    red = RedisPrefixIndex(make_client(redis_server.url, 1.0), namespace="exact:", ttl_s=60, timeout_s=1.0)
    try:
        for case in range(60):
            n = rng.choice([1, 2, 15, 16, 17, 64, 255, 256, 257, 511, 700])
            query = LONG[:n]
            mem = MemoryPrefixIndex(ttl_s=60)
            for w in range(4):
                depth = rng.randint(0, n)
                held = set(range(depth))
                for _ in range(rng.randint(0, 3)):  # holes: at chunk edges, next to them, anywhere
                    hole = rng.choice([rng.randrange(n), 2 ** rng.randint(0, 9) - 1, rng.choice([63, 64, 191, 192, 447, 448])])
                    held.discard(hole)
                held |= {rng.randrange(n) for _ in range(rng.randint(0, 5))}  # stray deeper blocks
                tiers = ["gpu", "host"] if w % 2 else ["gpu"]
                for i in sorted(held):
                    tier = tiers[i % len(tiers)]
                    await mem.publish(f"w{w}", [query[i]], tier)
                    await red.publish(f"w{w}", [query[i]], tier)
            want = await mem.longest_prefix(query)
            assert await red.longest_prefix(query) == want, case
            assert await red.longest_prefix(query, ["gpu"]) == await mem.longest_prefix(query, ["gpu"]), case
            for w in range(4):
                await red.drop_worker(f"w{w}")
    finally:
        await red.close()
