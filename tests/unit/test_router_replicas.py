"""Gateway replicas: a session another replica routed is found through the prefix index, not the hash."""
from __future__ import annotations

from cache.hashing import chain_hashes
from cache.memory_index import MemoryPrefixIndex
from gateway.pool import WorkerState
from gateway.router import PrefixRouter
from policy.config import RoutingConfig
from policy.routing import session_worker_for
from workers.protocol import BackendStats, GenerateRequest, WorkerInfo

PROMPT = list(range(300))  # a conversation so far, ~ one system prompt and a few turns


def worker(wid: str) -> WorkerState:
    return WorkerState(WorkerInfo(wid, "http://127.0.0.1:1", "loadtest", node_id="n1", block_size=16),
                       BackendStats(running=0, slots=4, kv_blocks_total=1000, block_size=16))


def session_hashed_to(wid: str, ids: list[str]) -> str:
    """A session id whose rendezvous hash (what a gateway that never saw it falls back to) is `wid`."""
    return next(s for s in (f"s{i}" for i in range(1000)) if session_worker_for(s, ids) == wid)


async def route(replicas_share: bool, cached: int, session: str) -> tuple[str, str]:
    index = MemoryPrefixIndex()
    await index.publish("a", chain_hashes(PROMPT[:cached], 16))  # another replica put the conversation on a
    router = PrefixRouter(index, RoutingConfig(), replicas_share=replicas_share)
    r = await router.choose([worker("a"), worker("b")], GenerateRequest(request_id="r", prompt_ids=PROMPT + [7] * 20,
                                                                         max_tokens=16, session_id=session))
    return r.worker.worker_id, r.reason


async def test_a_replica_that_never_saw_the_session_follows_the_index():
    session = session_hashed_to("b", ["a", "b"])
    # half the conversation cached on a: a replica sharing the traffic follows it there; a lone gateway
    # (which saw every turn, so an unknown session is a new one) gives the hash's worker its bonus
    assert await route(True, 160, session) == ("a", "prefix_hit")
    assert await route(False, 160, session) == ("b", "session_affinity")
    assert await route(True, 288, session) == ("a", "prefix_hit")


async def test_a_shared_prefix_under_half_the_prompt_is_not_the_conversation():
    session = session_hashed_to("b", ["a", "b"])
    # 64 of 320 tokens cached on a (a system prompt, say): a new conversation, treated as before
    assert await route(True, 64, session) == await route(False, 64, session) == ("b", "session_affinity")


async def test_a_replica_knows_the_sessions_it_routed():
    """What lets it route their next turns without first pulling the workers' block logs (gateway/completions)."""
    router = PrefixRouter(MemoryPrefixIndex(), RoutingConfig(), replicas_share=True)
    long_id = "x" * 500  # kept under its hash
    assert not router.knows("s1") and not router.knows(None) and not router.knows(long_id)
    for session in ("s1", long_id):
        await router.choose([worker("a"), worker("b")], GenerateRequest(request_id="r", prompt_ids=PROMPT,
                                                                         max_tokens=16, session_id=session))
    assert router.knows("s1") and router.knows(long_id) and not router.knows("s2")
