"""Which worker serves a request: a pure function of the workers' load and their cached prefixes.

    decision = choose_worker(candidates, prefix_hits, request, cfg)

- `candidates`: one `WorkerLoad` per known worker (unhealthy ones are never chosen).
- `prefix_hits`: worker_id -> leading blocks of this prompt that the worker holds (PrefixIndex.longest_prefix);
  pass {} when the index is unavailable, and routing falls back to load (and session affinity) only.
- `request`: `RouteRequest`; `cfg`: `policy.config.RoutingConfig` (its `strategy` picks the function).

The "pulse" strategy scores each worker by a cost in prefill-token equivalents, lowest wins:

    cost = (prompt - cache_weight * cached) + pending prefill
           + shared_device_cost * (pending prefill of the other workers on its device)
           + running_cost * running + queue_cost * (requests that would wait for a slot) + KV pressure
           - session bonus

so a long cached prefix pulls a request to its holder until the holder's queue costs more than the
prefill it saves. Guards against the known failure modes of prefix routers:
- hot prefix: only workers with a free slot, or whose occupancy (active/slots) is within
  `spread_threshold` of the least-loaded one, may win; so a shared system prompt cannot pile every
  request onto the worker that cached it first: the holder's load beyond that spreads the prefix
  (the other worker then caches it too);
- a miss (no worker holds `min_prefix_blocks`) goes to the least-loaded worker;
- workers sharing a device (fractions of one GPU, or a box's CPU cores) are charged each other's queued
  prefill: the device runs it all in time slices, so a neighbour with nothing queued is not idle, and moving a
  conversation away from its cache to it only recomputes the context (on the H200 replay, 4 workers to a
  GPU, 20 of 400 requests left their cache that way);
- `x-session-id` affinity is a cost credit, so it yields like any other preference under overload;
- a new conversation (an `x-session-id` with no worker yet) may go only to workers holding at most
  `session_spread` more live conversations than the emptiest: momentary occupancy cannot see that agents
  pinned to one worker will all come back with longer contexts (on the H200 replay every new session
  followed the shared system prompt to its first holder: 68 of 80 requests on one worker of four).
Baselines for the benchmark: round_robin, least_loaded, session_sticky (never yields except to health).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

from policy.config import RoutingConfig
from policy.types import RouteDecision, RouteReason, RouteRequest, WorkerLoad


def choose_worker(
    candidates: Sequence[WorkerLoad],
    prefix_hits: Mapping[str, int],
    request: RouteRequest,
    cfg: RoutingConfig,
) -> RouteDecision:
    """The worker for `request` under `cfg.strategy`, with the reason (see the module docstring)."""
    healthy = sorted((w for w in candidates if w.healthy), key=lambda w: w.worker_id)
    if not healthy:
        return RouteDecision(None, "no_healthy_worker", strategy=cfg.strategy)
    if len(healthy) == 1:
        only = healthy[0]
        cached = cached_tokens(only, prefix_hits, request, cfg)
        cost = _cost(only, cached, False, request, cfg)
        return RouteDecision(only.worker_id, "only_worker", cached, cost, cfg.strategy)
    return _STRATEGIES[cfg.strategy](healthy, prefix_hits, request, cfg)


def cached_tokens(w: WorkerLoad, prefix_hits: Mapping[str, int], request: RouteRequest, cfg: RoutingConfig) -> int:
    """Prompt tokens `w` is expected to serve from cache (the last prompt token is always computed)."""
    blocks = prefix_hits.get(w.worker_id, 0)
    if blocks < cfg.min_prefix_blocks:
        return 0
    return max(0, min(blocks * w.block_size, request.prompt_tokens - 1))


def session_worker_for(session_id: str, worker_ids: Sequence[str]) -> str:
    """Rendezvous hashing: every gateway maps a session to the same worker, and losing one worker
    moves only that worker's sessions."""

    def weight(worker_id: str) -> bytes:
        return hashlib.blake2b(f"{session_id}\0{worker_id}".encode(), digest_size=8).digest()

    return max(worker_ids, key=weight)


def _session_target(healthy: Sequence[WorkerLoad], request: RouteRequest) -> str | None:
    if not request.session_id:
        return None
    ids = [w.worker_id for w in healthy]
    if request.session_worker in ids:
        return request.session_worker
    return session_worker_for(request.session_id, ids)


def _cost(w: WorkerLoad, cached: int, is_session: bool, request: RouteRequest, cfg: RoutingConfig) -> float:
    running = min(w.active, w.slots)
    waiting_ahead = max(0, w.active + 1 - w.slots)  # +1: this request itself
    kv_over = max(0.0, w.kv_usage - cfg.kv_soft_limit) / max(1e-9, 1.0 - cfg.kv_soft_limit)
    cost = (
        request.prompt_tokens
        - cfg.cache_weight * cached
        + w.pending_prefill_tokens
        + cfg.shared_device_cost * w.shared_pending_prefill_tokens
        + cfg.running_cost_tokens * running
        + cfg.queue_cost_tokens * waiting_ahead
        + cfg.kv_pressure_cost_tokens * min(kv_over, 1.0)
    )
    return cost - cfg.session_bonus_tokens if is_session else cost


def _rotated(healthy: Sequence[WorkerLoad], seq: int) -> dict[str, int]:
    """Tie-break rank that rotates with the request counter, so equal workers share ties."""
    n = len(healthy)
    return {w.worker_id: (i - seq) % n for i, w in enumerate(healthy)}


def _pulse(healthy: Sequence[WorkerLoad], hits: Mapping[str, int], request: RouteRequest, cfg: RoutingConfig):
    session = _session_target(healthy, request)
    rank = _rotated(healthy, request.seq)
    cached = {w.worker_id: cached_tokens(w, hits, request, cfg) for w in healthy}
    cost = {w.worker_id: _cost(w, cached[w.worker_id], w.worker_id == session, request, cfg) for w in healthy}

    def key(w: WorkerLoad):
        return (cost[w.worker_id], w.occupancy, rank[w.worker_id])

    best = min(healthy, key=key)
    floor = min(w.occupancy for w in healthy)
    # A worker with a free slot is never "overloaded": its cached prefix is a real saving.
    eligible = [w for w in healthy if w.active < w.slots or w.occupancy <= floor + cfg.spread_threshold + 1e-9]
    if request.session_id and request.session_worker not in cost:  # a new conversation: balance them
        fewest = min(w.sessions for w in eligible)
        eligible = [w for w in eligible if w.sessions <= fewest + cfg.session_spread]
    chosen = best if best in eligible else min(eligible, key=key)
    reason = _pulse_reason(best, chosen, cached, session)
    c = chosen.worker_id
    return RouteDecision(c, reason, cached[c], cost[c], "pulse")


def _pulse_reason(best: WorkerLoad, chosen: WorkerLoad, cached: Mapping[str, int], session: str | None) -> RouteReason:
    if best is not chosen and cached[best.worker_id] > 0:  # the load guard overrode a prefix holder
        return "hot_prefix_spread"
    if cached[chosen.worker_id] > 0:
        return "prefix_hit"
    if session is None:
        return "least_loaded"
    return "session_affinity" if chosen.worker_id == session else "session_yield"


def _least_loaded_worker(healthy: Sequence[WorkerLoad], request: RouteRequest) -> WorkerLoad:
    rank = _rotated(healthy, request.seq)
    return min(healthy, key=lambda w: (w.occupancy, w.kv_usage, rank[w.worker_id]))


def _decision(w: WorkerLoad, reason: RouteReason, hits, request, cfg) -> RouteDecision:
    cached = cached_tokens(w, hits, request, cfg)
    return RouteDecision(w.worker_id, reason, cached, _cost(w, cached, False, request, cfg), cfg.strategy)


def _round_robin(healthy, hits, request, cfg):
    return _decision(healthy[request.seq % len(healthy)], "round_robin", hits, request, cfg)


def _least_loaded(healthy, hits, request, cfg):
    return _decision(_least_loaded_worker(healthy, request), "least_loaded", hits, request, cfg)


def _session_sticky(healthy, hits, request, cfg):
    session = _session_target(healthy, request)
    if session is None:
        return _least_loaded(healthy, hits, request, cfg)
    chosen = next(w for w in healthy if w.worker_id == session)
    return _decision(chosen, "session_sticky", hits, request, cfg)


_STRATEGIES: dict[str, Callable[..., RouteDecision]] = {
    "pulse": _pulse,
    "round_robin": _round_robin,
    "least_loaded": _least_loaded,
    "session_sticky": _session_sticky,
}
