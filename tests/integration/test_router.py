"""gateway.router: the real index (in-process and Redis) feeding the pure routing decision."""
from __future__ import annotations

import asyncio

from cache.hashing import chain_hashes
from cache.memory_index import MemoryPrefixIndex
from cache.redis_guard import make_client
from cache.redis_index import RedisPrefixIndex
from gateway.pool import WorkerState
from gateway.router import PrefixRouter, load_of
from policy.config import RoutingConfig
from tests.conftest_redis import redis_server  # noqa: F401  (fixture)
from workers.protocol import BackendStats, GenerateRequest, WorkerInfo


def worker(wid: str, running: int = 0, slots: int = 4, inflight: int = 0, device_id: str = "") -> WorkerState:
    s = WorkerState(WorkerInfo(wid, "http://127.0.0.1:1", "loadtest", node_id="n1", device_id=device_id,
                               block_size=16),
                    BackendStats(running=running, slots=slots, kv_blocks_total=1000, block_size=16))
    s.inflight = inflight
    return s


def gen(ids: list[int], session: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_ids=ids, max_tokens=16, session_id=session)


PROMPT = list(range(4000))


async def test_routes_to_the_prefix_holder_and_remembers_sessions():
    index = MemoryPrefixIndex()
    router = PrefixRouter(index, RoutingConfig())
    workers = [worker("a", running=1), worker("b", running=2), worker("c")]
    await index.publish("b", chain_hashes(PROMPT[:3200], 16))
    r = await router.choose(workers, gen(PROMPT, "s1"))
    assert (r.worker.worker_id, r.reason, r.cached_tokens, r.index_ok) == ("b", "prefix_hit", 3200, True)
    # next turn of s1 with nothing cached anywhere: its remembered worker, if not overloaded
    r = await router.choose(workers, gen(list(range(9000, 9100)), "s1"))
    assert (r.worker.worker_id, r.reason) == ("b", "session_affinity")
    assert load_of(workers[1]).active == 2


async def test_redis_down_routes_on_load_alone(redis_server):
    index = RedisPrefixIndex(make_client(redis_server.url, 0.2), namespace="t:", timeout_s=0.2, retry_interval_s=5)
    router = PrefixRouter(index, RoutingConfig())
    workers = [worker("a", running=3), worker("b", running=1)]
    try:
        await index.publish("a", chain_hashes(PROMPT, 16))
        assert (await router.choose(workers, gen(PROMPT))).worker.worker_id == "a"
        redis_server.stop()
        r = await router.choose(workers, gen(PROMPT))
        assert (r.worker.worker_id, r.reason, r.index_ok) == ("b", "least_loaded", False)
    finally:
        await index.close()


async def test_no_healthy_worker():
    w = worker("a")
    w.stats = BackendStats(healthy=False)
    r = await PrefixRouter(None, RoutingConfig()).choose([w], gen(PROMPT))
    assert r.worker is None and r.reason == "no_healthy_worker"


def test_session_hashes_match_a_fresh_hash_and_reuse_blocks():
    from gateway.router import SessionHashes

    cache = SessionHashes(1 << 20)
    turn1 = list(range(1000))
    assert cache.chain("s", turn1, 16) == chain_hashes(turn1, 16)
    turn2 = turn1 + list(range(5000, 5300))  # the agent resends its context plus a new turn
    assert cache.chain("s", turn2, 16) == chain_hashes(turn2, 16)
    assert cache.reused_blocks == 62
    edited = turn2[:500] + [7] + turn2[501:]  # an edit in the middle: blocks from 496 on change
    assert cache.chain("s", edited, 16) == chain_hashes(edited, 16)
    assert cache.reused_blocks == 62 + 31
    assert cache.chain("s", turn1[:40], 16) == chain_hashes(turn1[:40], 16)  # shorter than before
    assert cache.chain("s", edited, 8) == chain_hashes(edited, 8)  # another block size: no reuse
    assert cache.chain(None, turn1, 16) == chain_hashes(turn1, 16)
    small = SessionHashes(8000)  # room for one 1,000-token prompt (6,705 bytes: 3,968 of blocks, 62 hashes, overhead)
    small.chain("a", turn1, 16)
    small.chain("b", turn1, 16)
    small.chain("a", turn2, 16)
    assert small.reused_blocks == 0  # "a" was evicted by "b"


async def test_queued_prefill_at_the_holder_counts_against_it():
    """A worker's pending prefill (uncached prompt tokens sent there with no first token yet, kept by the
    dispatcher) is load the stats poll does not show yet: a prefix holder with more queued prefill than
    the prefix saves loses the request to an idle worker; with a little queued it keeps it."""
    index = MemoryPrefixIndex()
    router = PrefixRouter(index, RoutingConfig())
    a, b = worker("a"), worker("b", inflight=1)
    await index.publish("b", chain_hashes(PROMPT[:1600], 16))
    b.pending_prefill = 3000
    assert load_of(b).pending_prefill_tokens == 3000
    r = await router.choose([a, b], gen(PROMPT))
    assert (r.worker.worker_id, r.reason) == ("a", "least_loaded")
    b.pending_prefill = 200
    r = await router.choose([a, b], gen(PROMPT))
    assert (r.worker.worker_id, r.reason, r.cached_tokens) == ("b", "prefix_hit", 1600)


async def test_workers_sharing_a_device_are_charged_each_others_queued_prefill():
    """Workers on one GPU (or one box's cores) share its time: a neighbour with nothing queued is not idle
    while the holder's queued prefill runs on the same device, so the holder keeps the request (above it
    lost to a worker of its own). Per device: a worker elsewhere is still charged only its own queue."""
    index = MemoryPrefixIndex()
    await index.publish("b", chain_hashes(PROMPT[:1600], 16))
    a, b = worker("a", device_id="gpu-0"), worker("b", inflight=1, device_id="gpu-0")
    b.pending_prefill = 3000
    router = PrefixRouter(index, RoutingConfig())
    r = await router.choose([a, b], gen(PROMPT))
    assert (r.worker.worker_id, r.reason, r.cached_tokens) == ("b", "prefix_hit", 1600)
    assert r.decision.cost < 3000 + len(PROMPT)  # b: its own queue, not its own queue counted twice
    c = worker("c", device_id="gpu-1")
    r = await router.choose([a, b, c], gen(PROMPT))
    assert r.worker.worker_id == "c"  # on another GPU, nothing queued: the idle device wins
    r = await PrefixRouter(index, RoutingConfig(shared_device_cost=0)).choose([a, b], gen(PROMPT))
    assert r.worker.worker_id == "a"  # a partitioned device (MIG): each worker's own queue only


async def test_live_conversations_are_counted_per_worker_and_expire():
    """The router counts each worker's live x-session-id conversations (what spreads new ones) and forgets
    them after session_idle_s; a conversation that moves is counted once, where it went."""
    router = PrefixRouter(MemoryPrefixIndex(), RoutingConfig(session_idle_s=0.3))
    workers = [worker("a"), worker("b")]
    picks = [(await router.choose(workers, gen(list(range(i * 100, i * 100 + 50)), f"s{i}"))).worker.worker_id
             for i in range(4)]
    assert sorted(router.live_sessions().values()) == [2, 2] and sorted(picks) == ["a", "a", "b", "b"]
    workers[0] = worker("a", running=4, slots=1)  # s0's worker is overloaded: its next turn moves
    r = await router.choose(workers, gen(list(range(50)), "s0"))
    assert sum(router.live_sessions().values()) == 4
    assert router.live_sessions().get(r.worker.worker_id, 0) >= 1
    await asyncio.sleep(0.35)
    await router.choose(workers, gen(list(range(7000, 7050)), "late"))
    assert router.live_sessions() == {"b": 1}


async def test_the_prompt_is_hashed_from_the_candidates_model_root():
    """Two models (seeds 11 and 22) hold the same prompt ids: each model's lookup finds only its own
    workers' blocks, and a session that moves to the other model does not reuse the first one's hashes."""
    index = MemoryPrefixIndex()
    router = PrefixRouter(index, RoutingConfig())
    a, b = worker("a"), worker("b")
    a.info.prefix_seed, b.info.prefix_seed = 11, 22
    await index.publish("a", chain_hashes(PROMPT[:3200], 16, 11))
    r = await router.choose([a], gen(PROMPT, "s"))
    assert (r.cached_tokens, r.hashes) == (3200, chain_hashes(PROMPT, 16, 11))
    r = await router.choose([b], gen(PROMPT, "s"))
    assert (r.cached_tokens, r.hashes) == (0, chain_hashes(PROMPT, 16, 22))
    assert router.hashes.reused_blocks == 0
