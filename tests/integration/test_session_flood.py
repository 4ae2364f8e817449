"""A flood of distinct x-session-id values cannot grow the gateway's per-session state without bound.

The real router (gateway.router.PrefixRouter: SessionHashes, the session -> worker map, the live
conversation counts) over the in-process prefix index, fed 100,000 requests each with a new session id
(short prompts: under one block, which once stored 0 counted bytes and were never evicted; and long
ids: past MAX_SESSION_KEY they are keyed by their digest). Every structure stays within its bounds and
the process's resident memory grows by a bounded amount.
"""
from __future__ import annotations

import gc

from cache.memory_index import MemoryPrefixIndex
from gateway.pool import WorkerState
from gateway.router import ENTRY_OVERHEAD, MAX_SESSION_KEY, PrefixRouter, SessionHashes, session_key
from policy.config import RoutingConfig
from workers.protocol import BackendStats, GenerateRequest, WorkerInfo

FLOOD = 100_000
HASH_BYTES = 2 << 20
SESSIONS_MAX = 10_000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _worker(wid: str) -> WorkerState:
    return WorkerState(WorkerInfo(wid, "http://127.0.0.1:1", "loadtest", block_size=16),
                       BackendStats(slots=64, kv_blocks_total=1000, block_size=16))


async def test_100k_distinct_session_ids_stay_bounded():
    router = PrefixRouter(MemoryPrefixIndex(), RoutingConfig(), sessions_max=SESSIONS_MAX, hash_cache_bytes=HASH_BYTES)
    workers = [_worker("a"), _worker("b")]
    gc.collect()
    rss0 = _rss()
    for i in range(FLOOD):
        sid = f"flood-{i}" if i % 2 else f"{i}-" + "x" * 4000  # every other id is 4 KB long
        ids = [i % 1000, 7, 8] if i % 3 else list(range(i % 500, i % 500 + 40))  # under one block, or 2.5 blocks
        await router.choose(workers, GenerateRequest(request_id="r", prompt_ids=ids, max_tokens=4, session_id=sid))
    gc.collect()
    grown = _rss() - rss0
    hashes = router.hashes
    assert hashes.bytes <= HASH_BYTES
    assert len(hashes) <= HASH_BYTES // ENTRY_OVERHEAD  # a 0-token entry still costs its overhead
    assert len(hashes) > 1000  # the bound is bytes, not a tiny count: recent sessions keep their hashes
    assert len(router._sessions) <= SESSIONS_MAX and len(router._live) <= SESSIONS_MAX
    assert all(len(k) <= MAX_SESSION_KEY + 1 for k in router._sessions)
    # the previous router grew 118 MiB on this flood (0-byte entries never left); bounded, it grows ~8 MiB
    assert grown < 48 << 20, f"RSS grew {grown / 2**20:.1f} MiB over {FLOOD} session ids"


def test_an_entry_shorter_than_a_block_still_costs():
    cache = SessionHashes(ENTRY_OVERHEAD * 10)
    for i in range(1000):
        cache.chain(f"s{i}", [1, 2, 3], 16)  # no full block: no tokens, no hashes kept
    assert 0 < len(cache) < 10 and cache.bytes <= ENTRY_OVERHEAD * 10


def test_long_session_ids_are_keyed_by_their_digest():
    long = "x" * 10_000
    assert session_key(long) == session_key(long) != session_key(long[:-1] + "y")
    assert len(session_key(long)) <= MAX_SESSION_KEY and session_key("short") == "short" and session_key(None) is None
