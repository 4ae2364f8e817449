"""The gateway's router: prefix lookup in the PrefixIndex, then the pure policy.routing decision.

    router = PrefixRouter(index, cfg.routing)                   # index: MemoryPrefixIndex | RedisPrefixIndex | None
    result = await router.choose(workers, gen)                   # workers: routable WorkerStates; gen: GenerateRequest
    result.worker, result.reason, result.cached_tokens, result.index_ok, result.decision

Everything here is glue (no policy): hash the prompt's full blocks (cache.hashing.chain_hashes, the
definition the engine uses, from the root the candidate workers' model seeds it with, WorkerInfo.prefix_seed;
per x-session-id only the blocks new since its last prompt, SessionHashes),
ask the index once, build a `WorkerLoad` per worker from its last stats
and this gateway's fresher counts (in flight there, uncached prompt tokens waiting for their prefill there and
on the other workers of its device), remember which worker each `x-session-id` went to (bounded LRU),
and call `choose_worker`. When the index is unavailable (Redis down or slow) routing goes on with no
prefix hits: load and session affinity only, and `index_ok` is False (count it in a metric).
"""
from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import cachetools

from cache.hashing import ROOT_HASH, chain_hashes, chain_hashes_packed, pack_tokens
from cache.index import IndexUnavailable, PrefixIndex
from policy.config import RoutingConfig
from policy.routing import choose_worker
from policy.types import RouteDecision, RouteRequest, WorkerLoad


@dataclass
class RouteResult:
    worker: object | None  # the chosen WorkerState (None when no worker is healthy)
    reason: str
    cached_tokens: int
    index_ok: bool  # False: the index could not answer; routed on load alone
    decision: RouteDecision
    hashes: list[int] | None = None  # the prompt's full-block hashes (what the chosen worker will hold)
    lookup_s: float = 0.0  # time spent hashing the prompt and asking the index
    cpu_s: float = 0.0  # this thread's CPU time hashing, building loads and deciding (index round trip excluded)
    load: WorkerLoad | None = None  # the chosen worker's load as the decision saw it (what admission checks)


class PrefixRouter:
    def __init__(self, index: PrefixIndex | None, cfg: RoutingConfig, *, sessions_max: int = 100_000,
                 hash_cache_bytes: int = 64 << 20, replicas_share: bool = False):
        self.index = index
        # several gateway replicas: a session this one never routed may be another's, found in the index
        self.replicas_share = replicas_share
        self.cfg = cfg
        self.sessions_max = sessions_max
        self._sessions: cachetools.LRUCache = cachetools.LRUCache(maxsize=sessions_max)  # session -> last worker
        # conversations seen within cfg.session_idle_s, oldest first, and how many each worker holds
        self._live: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session id -> (worker id, last seen)
        self._live_count: Counter[str] = Counter()
        self._seq = itertools.count()
        self.hashes = SessionHashes(hash_cache_bytes)

    async def choose(self, workers: Sequence, gen) -> RouteResult:
        """`workers`: the candidate WorkerStates (gateway/pool.py)."""
        t0 = time.perf_counter()
        session = session_key(gen.session_id)
        hits, index_ok, hashes, cpu_s = await self._hits(workers, gen.prompt_ids, session)
        lookup_s = time.perf_counter() - t0
        c0 = time.thread_time()  # CPU, not wall: on a busy box the thread may lose the core mid-decision
        self._expire_live(time.monotonic())
        shared = shared_pending(workers)
        loads = [load_of(w, self._live_count[w.worker_id], shared.get(w.worker_id, 0)) for w in workers]
        request = RouteRequest(
            prompt_tokens=len(gen.prompt_ids),
            max_tokens=gen.max_tokens,
            session_id=session,
            session_worker=self._session_worker(session, hits, len(gen.prompt_ids), workers),
            seq=next(self._seq),
        )
        decision = choose_worker(loads, hits, request, self.cfg)
        at = next((i for i, w in enumerate(workers) if w.worker_id == decision.worker_id), None)
        chosen, load = (None, None) if at is None else (workers[at], loads[at])
        if session and chosen is not None:
            self._remember(session, chosen.worker_id)
        cpu_s += time.thread_time() - c0
        return RouteResult(chosen, decision.reason, decision.cached_tokens, index_ok, decision, hashes, lookup_s,
                           cpu_s, load)

    def _session_worker(self, session: str | None, hits: dict[str, int], prompt_tokens: int,
                        workers: Sequence) -> str | None:
        """Where the session's last turn went: this gateway's record; else, when gateway replicas share the
        traffic, the worker the index shows holding at least half of this prompt (the conversation so far,
        routed by another replica). Less than half is a shared system prompt, not this conversation."""
        if not session:
            return None
        known = self._sessions.get(session)
        if known is not None or not self.replicas_share or not hits:
            return known
        holder = max(hits, key=hits.__getitem__)
        block_size = workers[0].info.block_size if workers else 0
        return holder if 2 * hits[holder] * block_size >= prompt_tokens else None

    async def _hits(self, workers: Sequence, prompt_ids: list[int],
                    session: str | None) -> tuple[dict[str, int], bool, list[int] | None, float]:
        """(prefix hits, index answered, the prompt's block hashes, CPU seconds spent hashing)."""
        if self.index is None or not workers:
            return {}, True, None, 0.0
        block_size = workers[0].info.block_size  # one block size per deployment (EngineConfig.block_size)
        # the candidates hold the request's model (dispatch.holds), so they share its chain root
        root = workers[0].info.prefix_seed
        c0 = time.thread_time()
        hashes = self.hashes.chain(session, prompt_ids, block_size, root)
        cpu_s = time.thread_time() - c0
        if not hashes:
            return {}, True, hashes, cpu_s
        try:
            return await self.index.longest_prefix(hashes), True, hashes, cpu_s
        except IndexUnavailable:
            return {}, False, hashes, cpu_s

    def knows(self, session_id: str | None) -> bool:
        """Whether this gateway routed the session's last turn it saw (so it needs no fresher index to place it)."""
        session = session_key(session_id)
        return session is not None and session in self._sessions

    def _remember(self, session: str, worker_id: str) -> None:
        self._sessions[session] = worker_id
        before = self._live.pop(session, None)
        if before is not None:
            self._live_count[before[0]] -= 1
        self._live[session] = (worker_id, time.monotonic())
        self._live_count[worker_id] += 1
        if len(self._live) > self.sessions_max:
            self._drop_live()

    def _expire_live(self, now: float) -> None:
        """Forget conversations idle longer than session_idle_s (oldest first: O(1) per expired one)."""
        while self._live and now - next(iter(self._live.values()))[1] > self.cfg.session_idle_s:
            self._drop_live()

    def _drop_live(self) -> None:
        _, (worker_id, _) = self._live.popitem(last=False)
        self._live_count[worker_id] -= 1

    def live_sessions(self) -> dict[str, int]:
        """Live conversations per worker (for tests and /pulse/workers)."""
        return {w: n for w, n in self._live_count.items() if n > 0}


def shared_pending(workers: Sequence) -> dict[str, int]:
    """worker id -> prefill tokens queued on the other workers of its device (same node_id and device_id;
    workers with no device_id share with nobody)."""
    per_device: Counter[tuple[str, str]] = Counter()
    for w in workers:
        if w.info.device_id:
            per_device[w.info.node_id, w.info.device_id] += getattr(w, "pending_prefill", 0)
    return {w.worker_id: per_device[w.info.node_id, w.info.device_id] - getattr(w, "pending_prefill", 0)
            for w in workers if w.info.device_id}


def load_of(w, sessions: int = 0, shared_pending_prefill: int = 0) -> WorkerLoad:
    """A WorkerState as routing sees it: its last BackendStats plus what this gateway knows fresher than the
    last stats poll: requests in flight there (and how many of the polled ones were its own), the uncached
    prompt tokens still waiting for prefill (its own and its device neighbours'), and the live conversations
    it placed there."""
    return WorkerLoad(w.worker_id, **{
        **w.load_fields(),
        "inflight": w.inflight,
        "polled_inflight": w.polled_own,
        "pending_prefill_tokens": w.pending_prefill,
        "shared_pending_prefill_tokens": shared_pending_prefill,
        "healthy": w.healthy and w.stats.healthy,
        "block_size": w.info.block_size,
        "sessions": sessions,
        "refused": w.refused,
        # the other gateways' head for it came that long before the stats were read (admission.gateway_order)
        "others_head_priority": w.stats.gateways_head_priority,
        "others_head_since": w.last_seen - w.stats.gateways_head_waited_s,
    })


class SessionHashes:
    """Block hashes per session, so a growing agent context is hashed only in its new blocks.

    Agents resend their whole context every turn; hashing 16k tokens costs ~1-2 ms of gateway CPU. When
    a session's new prompt starts with the tokens its last prompt's full blocks covered (a byte compare),
    those hashes are reused and only the rest is hashed (chain_hashes from the last reused hash). An LRU
    bounded by `max_bytes` of what entries hold (`entry_bytes`: the id, the tokens, the hashes and a fixed
    overhead, so even a prompt shorter than one block costs its share): a flood of distinct session ids
    evicts old sessions, it cannot grow the map.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        # session -> ((block size, chain root), covered token bytes, hashes, session): the id is in the value so that
        # `entry_bytes` (cachetools sizes values only) counts it
        self._entries: cachetools.LRUCache = cachetools.LRUCache(maxsize=max(1, max_bytes), getsizeof=entry_bytes)
        self.reused_blocks = 0  # for metrics and tests

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return int(self._entries.currsize)

    def chain(self, session: str | None, ids: list[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
        """The chain hashes of `ids`' full blocks from `root` (the model's chain root hash)."""
        if not session or self.max_bytes <= 0:
            return chain_hashes(ids, block_size, root)
        raw = pack_tokens(ids)  # the gateway already checked ids are 32-bit non-negative
        shape = (block_size, root)  # a session that moves to another model starts its chain afresh
        hashes = self._reuse(session, raw, shape)
        done = 4 * len(hashes) * block_size
        hashes += chain_hashes_packed(raw[done:], block_size, hashes[-1] if hashes else root)
        self._store(session, shape, raw[: len(hashes) * block_size * 4], hashes)
        return list(hashes)

    def _reuse(self, session: str, raw: bytes, shape: tuple[int, int]) -> list[int]:
        entry = self._entries.get(session)
        if entry is None or entry[0] != shape:
            return []
        _, covered, hashes, _ = entry
        if raw.startswith(covered):
            self.reused_blocks += len(hashes)
            return list(hashes)
        # An edit (or a shorter prompt): reuse the blocks before the first differing one, found by a
        # binary search of C-level prefix compares.
        step = 4 * shape[0]
        lo, hi = 0, min(len(raw), len(covered)) // step
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if raw[: mid * step] == covered[: mid * step]:
                lo = mid
            else:
                hi = mid - 1
        keep = lo
        self.reused_blocks += keep
        return list(hashes[:keep])

    def _store(self, session: str, shape: tuple[int, int], covered: bytes, hashes: list[int]) -> None:
        self._entries.pop(session, None)
        entry = (shape, covered, tuple(hashes), session)
        if entry_bytes(entry) <= self.max_bytes:  # one larger than the whole cache is not kept
            self._entries[session] = entry


ENTRY_OVERHEAD = 320  # the LRU's node and key slot, the tuples, the root, the bytes and list headers (measured ~315)


def entry_bytes(entry: tuple) -> int:
    """What one SessionHashes entry holds: its tokens, 8-byte hashes (tuple slot; ints above 2**30 are
    objects of their own: 32 bytes), its session id, and a fixed overhead."""
    _, covered, hashes, key = entry
    return ENTRY_OVERHEAD + len(key) + len(covered) + 40 * len(hashes)


def session_key(session: str | None) -> str | None:
    """The id the router keys a conversation by: the client's own, or, past MAX_SESSION_KEY characters, its
    digest, so what a client sends in a header bounds neither the maps' bytes nor the work per request."""
    if session is None or len(session) <= MAX_SESSION_KEY:
        return session
    return "#" + hashlib.blake2b(session.encode(errors="surrogatepass"), digest_size=16).hexdigest()


MAX_SESSION_KEY = 128
