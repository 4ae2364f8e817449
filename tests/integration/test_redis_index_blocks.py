"""The Redis PrefixIndex's per-block layout (cache/redis_scripts.py) with a real redis-server: worker slots,
lapsed workers (their liveness key gone), bounded cleaning, slot reuse, snapshots by difference, tiers,
several slot groups, exact gaps, and a property test against a brute-force model of per-worker sets.

Every test also checks the layout's invariant from Redis's own keys: bit (slot, tier) of mask[h] is set
exactly when h is in held:<slot>:<tier>. A worker "lapses" here by deleting its liveness key, which is what
its TTL running out does (tests/integration/test_redis_index.py waits for a real TTL)."""
from __future__ import annotations

import asyncio
import itertools

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.hashing import chain_hashes
from cache.redis_guard import make_client
from cache.redis_index import RedisPrefixIndex, _pack
from cache.redis_scripts import CLEAN_BUDGET
from tests.conftest_redis import redis_server  # noqa: F401  (fixture)

H = chain_hashes(list(range(16 * 8)), 16)
TIERS = ("gpu", "host", "checkpoint")
GROUP = 10


def make_index(url: str, ns: str = "t:", snapshot_part: int = 8192) -> RedisPrefixIndex:
    return RedisPrefixIndex(make_client(url, 1.0), namespace=ns, ttl_s=60, timeout_s=1.0,
                            snapshot_part=snapshot_part)


async def slots(side: aioredis.Redis, ns: str = "t:") -> dict[str, int]:
    return {w.decode(): int(s) for w, s in (await side.hgetall(f"{ns}pfx2:slot")).items()}


async def dirty(side: aioredis.Redis, ns: str = "t:") -> set[int]:
    return {int(s) for s in await side.smembers(f"{ns}pfx2:dirty")}


async def lapse(side: aioredis.Redis, worker: str, ns: str = "t:") -> None:
    """What the worker's TTL running out does: its liveness key goes."""
    s = (await slots(side, ns))[worker]
    assert await side.delete(f"{ns}pfx2:alive:{s}") == 1


async def check_invariant(side: aioredis.Redis, ns: str = "t:") -> None:
    """mask[h]'s bit (slot, tier) is set iff h is in held:<slot>:<tier>; no zero masks are left behind."""
    want: dict[int, dict[bytes, int]] = {}
    async for key in side.scan_iter(match=f"{ns}pfx2:held:*"):
        _, _, s, tier = key.decode().rsplit(":", 3)
        s = int(s)
        for h in await side.smembers(key):
            masks = want.setdefault(s // GROUP, {})
            masks[h] = masks.get(h, 0) | 1 << (s % GROUP + GROUP * TIERS.index(tier))
    got: dict[int, dict[bytes, int]] = {}
    async for key in side.scan_iter(match=f"{ns}pfx2:mask:*"):
        fields = await side.hgetall(key)
        fields.pop(b"layout", None)
        if fields:
            got[int(key.decode().rsplit(":", 1)[1])] = {h: int(v) for h, v in fields.items()}
    assert got == {g: m for g, m in want.items() if m}


@pytest.fixture
async def side(redis_server):  # noqa: F811
    r = aioredis.Redis.from_url(redis_server.url)
    yield r
    await r.aclose()


async def test_a_lapsed_worker_is_ignored_then_cleaned_and_its_slot_reused_clean(redis_server, side):  # noqa: F811
    index = make_index(redis_server.url)
    try:
        await index.publish("w", H)
        await index.publish("v", H[:5], "host")
        assert await slots(side) == {"w": 0, "v": 1}
        await lapse(side, "v")
        assert await index.longest_prefix(H) == {"w": 8}
        assert await slots(side) == {"w": 0} and await dirty(side) == {1}  # retired by the lookup
        await index.publish("v", H[:2])  # back, with a fresh slot: its lapsed entries do not return
        assert await slots(side) == {"w": 0, "v": 2}
        assert await dirty(side) == set()  # that write cleaned slot 1 (5 entries, under the budget)
        assert await index.longest_prefix(H) == {"w": 8, "v": 2}
        assert await index.longest_prefix(H, ["host"]) == {}
        await index.publish("x", H[:1], "checkpoint")  # reuses slot 1, with none of v's old bits
        assert (await slots(side))["x"] == 1
        assert await index.longest_prefix(H, ["host", "checkpoint"]) == {"x": 1}
        await check_invariant(side)
    finally:
        await index.close()


async def test_cleaning_is_bounded_per_write_and_slots_wait_for_it(redis_server, side):  # noqa: F811
    index = make_index(redis_server.url)
    long = chain_hashes(list(range(16 * 4500)), 16)  # past one 4,000-hash chunk
    try:
        await index.publish("v", long, "gpu")
        await index.publish("v", long[:300], "host")
        await index.publish("w", long[:10])
        await lapse(side, "v")
        await index.publish("w", long[:11])  # retires v's slot 0, cleans CLEAN_BUDGET of its 4,800 entries
        assert await dirty(side) == {0}
        left = await side.scard("t:pfx2:held:0:gpu") + await side.scard("t:pfx2:held:0:host")
        assert left == 4800 - CLEAN_BUDGET
        await index.publish("x", long[:3])
        assert (await slots(side))["x"] == 2  # slot 0 is not reused while it still has bits
        assert await index.longest_prefix(long) == {"w": 11, "x": 3}
        await check_invariant(side)
        for _ in range(-(-4800 // CLEAN_BUDGET)):
            await index.evict("w", [long[4499]])  # any write cleans a little
        assert await dirty(side) == set()
        assert await side.exists("t:pfx2:held:0:gpu", "t:pfx2:held:0:host") == 0
        await check_invariant(side)
        await index.publish("y", long[:1])
        assert (await slots(side))["y"] == 0
    finally:
        await index.close()


async def test_drop_worker_forgets_at_once_and_frees_its_slot(redis_server, side):  # noqa: F811
    index = make_index(redis_server.url)
    try:
        await index.publish("w", H)
        await index.publish("w", H[:3], "checkpoint")
        await index.publish("v", H[:4])
        await index.drop_worker("w")
        assert await slots(side) == {"v": 1}
        assert await side.exists("t:pfx2:held:0:gpu", "t:pfx2:held:0:checkpoint", "t:pfx2:alive:0") == 0
        assert await index.longest_prefix(H) == {"v": 4}
        await check_invariant(side)
        await index.publish("u", H[:1])
        assert (await slots(side))["u"] == 0
        await index.drop_worker("w")  # unknown now: nothing happens
        await index.drop_worker("v")
        await index.drop_worker("u")
        assert sorted([k.decode() async for k in side.scan_iter(match="t:*")]) == ["t:pfx2:epoch", "t:pfx2:mask:0"]
    finally:
        await index.close()


async def test_snapshot_replaces_a_workers_entries_by_difference(redis_server, side):  # noqa: F811
    index = make_index(redis_server.url)
    try:
        await index.publish("w", H, "gpu")
        await index.publish("w", H[:4], "host")
        await index.publish("v", H[:6], "gpu")
        await index.snapshot("w", {"gpu": H[2:6], "checkpoint": H[:3]})
        assert await side.smembers("t:pfx2:held:0:gpu") == {_pack([h]) for h in H[2:6]}
        assert await side.exists("t:pfx2:held:0:host") == 0  # a tier left out of the snapshot is emptied
        assert await index.longest_prefix(H) == {"w": 6, "v": 6}  # checkpoint 0-2 then gpu 2-5
        assert await index.longest_prefix(H, ["gpu"]) == {"v": 6}
        assert await index.longest_prefix(H, ["checkpoint"]) == {"w": 3}
        await check_invariant(side)
        await index.snapshot("w", {"gpu": []})
        assert await slots(side) == {"v": 1}  # an empty snapshot frees the slot
        assert await index.longest_prefix(H) == {"v": 6}
        await check_invariant(side)
    finally:
        await index.close()


async def test_a_snapshot_in_parts_replaces_like_one_and_leaves_no_staging(redis_server, side):  # noqa: F811
    """Parts of 3 hashes: the same entries as the one-script snapshot (by difference, a tier left out is
    emptied); a snapshot that stopped after its first part (the worker lost Redis) is undone by the next
    one, and no staging set is left."""
    index = make_index(redis_server.url, snapshot_part=3)
    try:
        await index.publish("w", H[:8], "gpu")
        await index.publish("w", H[:2], "host")
        # an abandoned snapshot: one part, never ended; it added H[7] (already held) and nothing else
        await index._call("snapshot_part", ["w", 60, "1", "gpu", _pack(H[7:8])], 5.0)
        await index.snapshot("w", {"gpu": H[2:6], "checkpoint": H[:4]})
        assert await index.longest_prefix(H[:6], ["gpu"]) == {}
        assert await index.longest_prefix(H[2:6], ["gpu"]) == {"w": 4}
        assert await index.longest_prefix(H[:6], ["checkpoint"]) == {"w": 4}
        assert await index.longest_prefix(H[:2], ["host"]) == {}  # left out: emptied
        assert await side.smembers("t:pfx2:held:0:gpu") == set(_pack(H[2:6])[i:i + 8] for i in range(0, 32, 8))
        assert [k async for k in side.scan_iter(match="t:pfx2:snap:*")] == []
        await check_invariant(side)
    finally:
        await index.close()


async def test_many_workers_span_several_slot_groups(redis_server, side):  # noqa: F811
    index = make_index(redis_server.url)
    long = chain_hashes(list(range(16 * 40)), 16)
    try:
        for n in range(23):  # slots 0..22: groups 0, 1 and 2
            await index.publish(f"w{n}", long[: n + 1], TIERS[n % 3])
        assert await index.longest_prefix(long) == {f"w{n}": n + 1 for n in range(23)}
        assert await index.longest_prefix(long, ["host"]) == {f"w{n}": n + 1 for n in range(1, 23, 3)}
        for n in range(0, 23, 2):
            await index.drop_worker(f"w{n}")
        await lapse(side, "w21")
        assert await index.longest_prefix(long[:10]) == {f"w{n}": min(n + 1, 10) for n in range(1, 21, 2)}
        await check_invariant(side)
    finally:
        await index.close()


async def test_a_gap_anywhere_is_found_exactly(redis_server, side):  # noqa: F811
    index = make_index(redis_server.url)
    long = chain_hashes(list(range(16 * 1024)), 16)
    try:
        for gap in (0, 63, 64, 700, 1023):
            await index.snapshot("g", {"gpu": [h for i, h in enumerate(long) if i != gap]})
            await index.publish("full", long)
            await index.snapshot("half", {"gpu": long[:600], "host": long[600:]})  # tiers change mid-run
            want = {"full": 1024, "half": 1024} | ({"g": gap} if gap else {})
            assert await index.longest_prefix(long) == want, gap
            assert await index.longest_prefix(long, ["gpu"]) == {"full": 1024, "half": 600} | (
                {"g": gap} if gap else {}), gap
        await check_invariant(side)
    finally:
        await index.close()


async def test_everything_lapsed_unlinks_the_layout(redis_server, side):  # noqa: F811
    index = make_index(redis_server.url)
    try:
        await index.publish("w", H)
        await index.publish("v", H[:2])
        await lapse(side, "w")
        assert await index.longest_prefix(H) == {"v": 2}
        await lapse(side, "v")
        assert await index.longest_prefix(H) == {}
        assert [k async for k in side.scan_iter(match="t:*")] == [b"t:pfx2:epoch"]
        await index.publish("w", H[:1])
        assert await slots(side) == {"w": 0}
        assert await index.longest_prefix(H) == {"w": 1}
    finally:
        await index.close()


async def test_small_mask_hashes_stay_hashtables(redis_server, side):  # noqa: F811
    """A listpack-encoded hash (<= 512 small fields) scans on every field read: ~20x slower lookups."""
    index = make_index(redis_server.url)
    try:
        await index.publish("w", H[:3])
        assert await side.object("encoding", "t:pfx2:mask:0") == b"hashtable"
    finally:
        await index.close()


# ---- property: the lookup equals a brute-force model of per-worker, per-tier sets --------------------

UNIVERSE = chain_hashes(list(range(16 * 70)), 16)  # 70 blocks: past the first HMGET chunk (64)
WORKERS = [f"w{n}" for n in range(12)]  # two slot groups
idx_lists = st.lists(st.integers(0, 69), max_size=70)
op = st.one_of(
    st.tuples(st.just("publish"), st.sampled_from(WORKERS), st.sampled_from(TIERS), idx_lists),
    st.tuples(st.just("prefix"), st.sampled_from(WORKERS), st.sampled_from(TIERS), st.integers(0, 70)),
    st.tuples(st.just("evict"), st.sampled_from(WORKERS), st.sampled_from([*TIERS, None]), idx_lists),
    st.tuples(st.just("snapshot"), st.sampled_from(WORKERS), st.dictionaries(st.sampled_from(TIERS), idx_lists)),
    st.tuples(st.just("drop"), st.sampled_from(WORKERS)),
    st.tuples(st.just("lapse"), st.sampled_from(WORKERS)),
)
queries = st.lists(st.tuples(st.integers(1, 70), st.sets(st.sampled_from(TIERS), min_size=1)), min_size=1, max_size=3)


def model_longest(model: dict[str, dict[str, set[int]]], n: int, tiers) -> dict[str, int]:
    out = {}
    for w, by_tier in model.items():
        held = set().union(*(by_tier.get(t, set()) for t in tiers))
        depth = next((i for i in range(n) if i not in held), n)
        if depth:
            out[w] = depth
    return out


async def apply(index, side, ns, model, step) -> None:
    kind, w = step[0], step[1]
    if kind == "publish" or kind == "prefix":
        idx = step[3] if kind == "publish" else list(range(step[3]))
        await index.publish(w, [UNIVERSE[i] for i in idx], step[2])
        if idx:
            model.setdefault(w, {}).setdefault(step[2], set()).update(idx)
    elif kind == "evict":
        await index.evict(w, [UNIVERSE[i] for i in step[3]], step[2])
        for t in (TIERS if step[2] is None else [step[2]]):
            model.get(w, {}).get(t, set()).difference_update(step[3])
    elif kind == "snapshot":
        await index.snapshot(w, {t: [UNIVERSE[i] for i in idx] for t, idx in step[2].items()})
        model[w] = {t: set(idx) for t, idx in step[2].items()}
    elif kind == "drop":
        await index.drop_worker(w)
        model.pop(w, None)
    elif w in await slots(side, ns):  # lapse: only a worker with a slot has a liveness key
        await lapse(side, w, ns)
        model.pop(w, None)


_examples = itertools.count()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(op, min_size=1, max_size=12), qs=queries, part=st.sampled_from([8192, 5]))
def test_lookup_equals_a_brute_force_model(redis_server, steps, qs, part):  # noqa: F811
    """`part` 5: every snapshot of more than 5 hashes goes in parts (SNAPSHOT_PART ... SNAPSHOT_END)."""
    async def run():
        ns = f"h{next(_examples)}:"
        index = make_index(redis_server.url, ns, part)
        side = aioredis.Redis.from_url(redis_server.url)
        model: dict[str, dict[str, set[int]]] = {}
        try:
            for step in steps:
                await apply(index, side, ns, model, step)
                for n, tiers in qs:
                    assert await index.longest_prefix(UNIVERSE[:n], tiers) == model_longest(model, n, tiers), step
            await check_invariant(side, ns)
        finally:
            await side.aclose()
            await index.close()

    asyncio.run(run())
