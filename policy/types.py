"""Plain data that routing and admission decide on. No I/O; the gateway fills these in.

- `WorkerLoad`: one worker as the router sees it. Build it from a worker's BackendStats plus what this
  gateway knows fresher than the last stats poll (requests it has in flight there, and how many of the
  polled ones were its own):
      WorkerLoad.from_stats(worker_id, msgspec.structs.asdict(stats), inflight=n, polled_inflight=m,
                            pending_prefill_tokens=t)
- `RouteRequest`: what routing needs of a request (token counts, session, a per-gateway sequence number).
- `RouteDecision`: the chosen worker (None if none can serve) and a short machine-readable reason.
- `AdmissionRequest`, `QueueState`, `AdmissionDecision`: admission's inputs and answer.

They are frozen msgspec Structs, not frozen dataclasses: the gateway builds several per request (a WorkerLoad per
candidate worker on every routing decision and admission re-check), and a frozen dataclass's construction sets
each field through object.__setattr__ (a 24-field WorkerLoad: ~9.5 us against ~3 us for the Struct on the 2-core
box; a whole routing decision with one worker 58 -> 44 us).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

RouteReason = Literal[
    "prefix_hit",  # best cost, helped by a cached prefix
    "least_loaded",  # no useful cached prefix anywhere: least-loaded worker
    "hot_prefix_spread",  # the prefix holder was overloaded against the others; went elsewhere
    "session_affinity",  # the session's worker, still within the load threshold
    "session_yield",  # the session's worker was overloaded; went elsewhere
    "round_robin",
    "session_sticky",  # the session-sticky strategy (never yields except to health)
    "only_worker",  # a single healthy candidate
    "no_healthy_worker",
]


class WorkerLoad(msgspec.Struct, frozen=True):
    """A worker's load. Field names match workers.protocol.BackendStats, plus gateway-side counts."""

    worker_id: str
    healthy: bool = True
    running: int = 0  # sequences generating now (from stats)
    waiting: int = 0  # sequences queued inside the backend (from stats)
    slots: int = 1  # sequences it can run at once
    queue_max: int | None = None  # requests beyond its slots it would hold waiting (its profile's); None: no word
    kv_blocks_total: int = 0  # 0: unknown (e.g. llama-server); KV checks are then skipped
    kv_blocks_used: int = 0
    block_size: int = 16
    tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    inflight: int = 0  # requests this gateway has outstanding at the worker (fresher than stats)
    # of running + waiting, the requests that were this gateway's own when the stats were taken; None: unknown,
    # taken as all of `inflight` (which makes `active` the larger of the two counts)
    polled_inflight: int | None = None
    pending_prefill_tokens: int = 0  # prompt tokens sent there that have not produced a first token yet
    shared_pending_prefill_tokens: int = 0  # the same, summed over the other workers on this worker's device
    reserved_kv_tokens: int = 0  # KV tokens admitted there by this gateway but not yet visible in stats
    sessions: int = 0  # x-session-id conversations this gateway placed there, seen within session_idle_s
    gateways_waiting: int = 0  # requests queued in the other gateways' admission queues (their last word to it)
    other_gateways: int = 0  # the other gateways that told it their queue lately (admission pools queue_max with them)
    # the earliest-come head among the other gateways' queues that waits for this worker (their last word to it):
    # its priority (None: no other gateway's head waits for it) and when it came, on this gateway's clock
    # (time.monotonic(): the worker's figure of how long it had waited, taken from when its stats were read)
    others_head_priority: int | None = None
    others_head_since: float = 0.0
    refused: bool = False  # it answered 429 (full) since its last stats poll: full until a poll says otherwise

    @classmethod
    def from_stats(cls, worker_id: str, stats: Mapping[str, Any], **extra: Any) -> WorkerLoad:
        """From a BackendStats as a dict; unknown keys (e.g. preemptions) are ignored."""
        known = _WORKER_LOAD_FIELDS
        values = {k: v for k, v in stats.items() if k in known}
        values.update(extra)
        return cls(worker_id=worker_id, **values)

    @property
    def active(self) -> int:
        """Requests at the worker: the others' as its stats counted them, plus this gateway's as of now (so a
        request of this gateway that ended since the stats stops counting at once)."""
        own = self.inflight if self.polled_inflight is None else self.polled_inflight
        active = max(0, self.running + self.waiting - own) + self.inflight
        return max(active, self.slots + 1) if self.refused else active

    @property
    def occupancy(self) -> float:
        """Active requests per slot: 1.0 = every slot busy; above 1 requests queue."""
        return self.active / max(self.slots, 1)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, counting this gateway's reservations; 0 when unknown."""
        if self.kv_blocks_total <= 0:
            return 0.0
        reserved_blocks = self.reserved_kv_tokens / max(self.block_size, 1)
        return min(1.0, (self.kv_blocks_used + reserved_blocks) / self.kv_blocks_total)

    @property
    def kv_free_tokens(self) -> int | None:
        """KV tokens still free (None when the worker does not report KV)."""
        if self.kv_blocks_total <= 0:
            return None
        free_blocks = self.kv_blocks_total - self.kv_blocks_used
        return max(0, free_blocks * self.block_size - self.reserved_kv_tokens)


_WORKER_LOAD_FIELDS = frozenset(WorkerLoad.__struct_fields__) - {"worker_id"}


def load_fields(stats: Any) -> dict[str, Any]:
    """A BackendStats (any msgspec Struct) as WorkerLoad keyword arguments: the fields both have."""
    return {k: getattr(stats, k) for k in stats.__struct_fields__ if k in _WORKER_LOAD_FIELDS}


class RouteRequest(msgspec.Struct, frozen=True):
    prompt_tokens: int
    max_tokens: int = 0
    session_id: str | None = None  # x-session-id
    session_worker: str | None = None  # where this session went last (if the gateway remembers); else hashed
    seq: int = 0  # per-gateway request counter: round-robin position and tie-break rotation


class RouteDecision(msgspec.Struct, frozen=True):
    worker_id: str | None  # None only with reason "no_healthy_worker"
    reason: RouteReason
    cached_tokens: int = 0  # prompt tokens the chosen worker is expected to hold
    cost: float = 0.0  # the chosen worker's cost in token-equivalents (lower is better)
    strategy: str = "pulse"


class AdmissionRequest(msgspec.Struct, frozen=True):
    prompt_tokens: int
    max_tokens: int
    cached_tokens: int = 0  # prefix the target worker holds (from the routing decision)
    priority: int = 0  # higher is more important; below 0 is "background"
    context_length: int = 0  # the served context window; 0: unknown (no 400 check)


class QueueState(msgspec.Struct, frozen=True):
    """The gateway's admission queue right now."""

    depth_by_priority: Mapping[int, int] = msgspec.field(default_factory=dict)  # queued requests per priority
    drain_rate_per_s: float = 0.0  # requests leaving the queue per second, measured (DrainRate)
    queued: int = 0  # everyone in the queue, those behind the asking request too (its demand: admission's share)
    # when the asking request came to the gateway (time.monotonic()), for the order across gateway replicas
    # (admission.gateway_order); None: unknown, no such order
    since: float | None = None

    @property
    def depth(self) -> int:
        return sum(self.depth_by_priority.values())

    def ahead_of(self, priority: int) -> int:
        """Queued requests served before a new one of this priority (same or higher priority)."""
        return sum(n for p, n in self.depth_by_priority.items() if p >= priority)


AdmissionAction = Literal["admit", "queue", "reject"]


class AdmissionDecision(msgspec.Struct, frozen=True):
    action: AdmissionAction
    status: int = 200  # HTTP status to answer with when rejected (400, 429, 503)
    code: str = ""  # OpenAI-style error code, e.g. "rate_limited", "context_length_exceeded"
    message: str = ""
    retry_after_s: int | None = None  # for the Retry-After header (429/503)
    deadline_s: float | None = None  # for "queue": give up (429) if not admitted within this many seconds
    max_tokens: int = 0  # the max_tokens to run with (clamped when AdmissionConfig.clamp_max_tokens)
