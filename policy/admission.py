"""Whether a request runs now, waits in the gateway's queue, or is refused, and with what answer.

    decision = admit(target, request, queue, cfg)

- `target`: the `WorkerLoad` routing chose (None when routing found no healthy worker).
- `request`: `AdmissionRequest` (prompt and max tokens, the cached prefix the target holds, priority,
  the served context length).
- `queue`: `QueueState` of the gateway's admission queue (depth per priority, measured drain rate).
- `cfg`: `policy.config.AdmissionConfig`.

The answer (`AdmissionDecision`):
- "admit": send it now, with `max_tokens` (clamped only when cfg.clamp_max_tokens);
- "queue": hold it at most `deadline_s`; while it waits, call `admit` again for the head of the queue
  (with the queue state not counting that request); past the deadline answer `expired(queue, cfg)`;
- "reject": answer `status` (400 context overflow, 429 busy, 503 no healthy worker) with `code`,
  `message` and, for 429/503, `retry_after_s` for the Retry-After header.

A request fits when the target's free KV (blocks free, less this gateway's reservations) holds its new
tokens (prompt - cached prefix + kv_reserve_fraction * max_tokens) and the target has a slot or room in
its own queue (`worker_queue`: cfg.worker_queue_max where set, else what the worker says it holds at no cost
per step, else 4). Requests queue in priority order: a new request never overtakes
queued requests of the same or higher priority. `DrainRate` measures how fast the queue empties;
Retry-After is the time the queue ahead would take to drain at that rate.

Who goes first among queued requests is `FairOrder`: higher priority first, and within one priority
start-time fair queueing across tenants (API keys), so one key's flood cannot starve another's requests.
Across the gateway replicas that share a worker, `gateway_order` lets the replicas' heads go in priority and
arrival order, and `over_share` splits the places by demand where their heads came close together.
A request's priority comes from its key (`effective_priority`): a client may ask for less, never more.
"""
from __future__ import annotations

import math

import cachetools

from policy.config import AdmissionConfig
from policy.types import AdmissionDecision, AdmissionRequest, QueueState, WorkerLoad


def admit(
    target: WorkerLoad | None, request: AdmissionRequest, queue: QueueState, cfg: AdmissionConfig
) -> AdmissionDecision:
    overflow = _context_overflow(request, cfg)
    if overflow is not None:
        return overflow
    max_tokens = _effective_max_tokens(request, cfg)
    if target is None or not target.healthy:
        return AdmissionDecision(
            "reject", 503, "no_healthy_worker", "No healthy worker can take this request; retry shortly.",
            retry_after_s=cfg.no_worker_retry_after_s,
        )
    too_big = _never_fits(target, request, max_tokens, cfg)
    if too_big is not None:
        return too_big
    if queue.ahead_of(request.priority) == 0 and _fits_now(target, request, max_tokens, cfg):
        order = gateway_order(target, request, queue, cfg)
        if order > 0 or (order == 0 and not over_share(target, queue, cfg)):
            return AdmissionDecision("admit", max_tokens=max_tokens)
    return _queue_or_reject(request, queue, cfg, max_tokens, target)


def expired(queue: QueueState, cfg: AdmissionConfig) -> AdmissionDecision:
    """The 429 for a request that waited its whole deadline in the queue."""
    retry = retry_after(queue.depth, queue, cfg)
    return AdmissionDecision(
        "reject", 429, "server_overloaded",
        f"Waited {cfg.queue_deadline_s:g} s in the queue without a free worker; retry after {retry} s.",
        retry_after_s=retry,
    )


def retry_after(ahead: int, queue: QueueState, cfg: AdmissionConfig) -> int:
    """Seconds until `ahead` queued requests drain at the measured rate, within [1, max_retry_after_s]."""
    if queue.drain_rate_per_s <= 0:
        return cfg.default_retry_after_s
    seconds = min(float(cfg.max_retry_after_s), (ahead + 1) / queue.drain_rate_per_s)  # min first: rate may be ~0
    return max(1, math.ceil(seconds))


def kv_tokens_needed(request: AdmissionRequest, max_tokens: int, cfg: AdmissionConfig) -> int:
    """New KV tokens the request takes on its worker: the cached prefix is shared, so it is credited."""
    reserve = math.ceil(max_tokens * cfg.kv_reserve_fraction)
    return max(0, request.prompt_tokens - request.cached_tokens) + reserve


def _context_overflow(request: AdmissionRequest, cfg: AdmissionConfig) -> AdmissionDecision | None:
    ctx = request.context_length
    if ctx <= 0:
        return None
    prompt, asked = request.prompt_tokens, request.prompt_tokens + request.max_tokens
    if prompt >= ctx:
        return _reject_400(
            f"This model's maximum context length is {ctx} tokens, but the prompt has {prompt} tokens: "
            f"{prompt - ctx + 1} over (at least one token must be left for the completion). Shorten the messages."
        )
    if asked > ctx and not cfg.clamp_max_tokens:
        return _reject_400(
            f"This model's maximum context length is {ctx} tokens, but you requested {asked} tokens "
            f"({prompt} in the messages, {request.max_tokens} in the completion): {asked - ctx} over. "
            f"Lower max_tokens to at most {ctx - prompt} or shorten the messages."
        )
    return None


def _effective_max_tokens(request: AdmissionRequest, cfg: AdmissionConfig) -> int:
    if cfg.clamp_max_tokens and request.context_length > 0:
        return min(request.max_tokens, request.context_length - request.prompt_tokens)
    return request.max_tokens


def _never_fits(w: WorkerLoad, request: AdmissionRequest, max_tokens: int, cfg: AdmissionConfig):
    """A request larger than the worker's whole KV cache can never run there: 400, not a retry loop."""
    if w.kv_blocks_total <= 0:
        return None
    capacity = w.kv_blocks_total * w.block_size
    need = request.prompt_tokens + math.ceil(max_tokens * cfg.kv_reserve_fraction)
    if need <= capacity:
        return None
    return _reject_400(
        f"The request needs {need} KV tokens (prompt {request.prompt_tokens} + completion {max_tokens}) but a "
        f"worker holds at most {capacity}: {need - capacity} over. Lower max_tokens or shorten the messages."
    )


DEFAULT_WORKER_QUEUE = 4


def worker_queue(w: WorkerLoad, cfg: AdmissionConfig) -> int:
    """Requests beyond its slots `w` may be sent: the operator's admission.worker_queue_max where set, else the
    worker's own figure (its device profile's worker_queue: the GPU engine's scheduler queue, where a finished
    sequence's place is refilled at the next step instead of after the gateway hears of the end; llama-server: as
    many as its slots, in its own queue, which keeps arrival order across the gateway's replicas), else 4.

    A deeper worker queue fills the batch past saturation (on the H200, 128 beyond 256 places: decoding sequences
    a step 177-180 -> 214-216 of 256 at 512-1,000 clients, served tok/s 1.06-1.11x, TTFT p50 lower; BENCHMARKS.md,
    issue 25), but the requests in it are served in arrival order: tenant fairness (FairOrder) holds only for
    what waits in the gateway, so profiles set it where the batch is large against the queue."""
    if cfg.worker_queue_max is not None:
        return cfg.worker_queue_max
    return DEFAULT_WORKER_QUEUE if w.queue_max is None else w.queue_max


def _fits_now(w: WorkerLoad, request: AdmissionRequest, max_tokens: int, cfg: AdmissionConfig) -> bool:
    if w.refused or w.active >= w.slots + worker_queue(w, cfg):
        return False
    return _kv_fits(w, request, max_tokens, cfg)


def _kv_fits(w: WorkerLoad, request: AdmissionRequest, max_tokens: int, cfg: AdmissionConfig) -> bool:
    """The worker's free KV (as its stats said, less this gateway's reservations) holds the request's new tokens;
    True when the worker reports no KV."""
    free = w.kv_free_tokens
    return free is None or kv_tokens_needed(request, max_tokens, cfg) <= free


def waits_on_stats(w: WorkerLoad | None, request: AdmissionRequest, cfg: AdmissionConfig) -> bool:
    """Whether a request `admit` queued for `w` waits for what only the worker's next stats can show: a place
    held by a request that is not this gateway's (another replica shares the worker, or the worker still counts
    requests this gateway does not), a refusal that only a poll clears, or KV the worker frees (its used blocks
    come with its stats). False: it waits only for places this gateway's own requests hold, and the end of any
    of them re-checks it at once (the gateway's AdmissionGate.leave), so polling the worker for it is waste."""
    if w is None or not w.healthy or w.refused or w.other_gateways > 0 or w.gateways_waiting > 0 \
            or w.active > w.inflight:
        return True
    return not _kv_fits(w, request, _effective_max_tokens(request, cfg), cfg)


def over_share(w: WorkerLoad, queue: QueueState, cfg: AdmissionConfig) -> bool:
    """Whether this gateway already holds its share of the worker's places while other gateways have requests
    waiting for them: then a place it frees is left to them (they see it at their next stats poll).

    Each gateway replica refills the places its own requests free the moment they leave, and sees the others'
    only through the worker's stats, so without this the share of the places each replica held stayed where the
    first burst left it: on the H200 at 1,000 clients over 4 replicas a replica holding few places kept a long
    queue (TTFT p99 8.5 s against a p50 of 1.0 s) and passed its queue_max while the others' queues were short
    (BENCHMARKS.md, issue 25). A replica's share is the worker's places (slots and its own queue) in proportion
    to its demand (its requests there, and its queue) against everyone's (the worker's other requests and the
    other gateways' queues, as they last told the worker), rounded to the nearest place and at least one. Rounded
    up, two replicas with 8 and 4 requests for 2 places would both have 2 (the first to take them kept them);
    rounded to the nearest, a place can stay free while others wait (shares of 85.3 places each for 256), at most
    half a place a replica."""
    if w.gateways_waiting <= 0:
        return False
    mine = w.inflight + max(1, queue.queued)
    others = max(0, w.active - w.inflight) + w.gateways_waiting
    share = max(1, math.floor((w.slots + worker_queue(w, cfg)) * mine / (mine + others) + 0.5))
    return w.inflight >= share


def gateway_order(w: WorkerLoad, request: AdmissionRequest, queue: QueueState, cfg: AdmissionConfig) -> int:
    """Where the asking request stands against the other gateway replicas' queued heads for worker `w` (as the
    worker last told this gateway): -1 when one of them goes first (a higher priority, or the same one and it came
    more than `cfg.gateway_order_s` before this request): the place is left to it; 1 when this request goes first
    (a higher priority than theirs, or it came that much before them): it takes a place whatever its replica's
    share (`over_share`); 0 when neither, or no other replica's request waits for `w`: the shares decide.

    Each replica refills the places its own requests free the moment they end and hears of the others' only at
    its next stats poll, so without this a replica's newest arrivals took the places while another replica's
    older head waited a whole generation more (on the H100, 32 clients on llama-server's 16 slots over 4
    replicas: requests that had come 10-18 ms before took freed slots while four that had waited 2.18 s were sent
    beyond the slots; at 64 clients on 16 slots over 2 replicas on the 2-core box, TTFT p99 14.6-19.0 s against
    llama-server's own 9.5-12.3 s; BENCHMARKS.md, issue 18). Across replicas the order is priority, then arrival:
    the tenants' turns (FairOrder) hold within a replica's queue, which picks the head it reports. The margin
    covers the news's age (each replica's word reaches the others one or two stats polls late): a place left to
    a head another replica has meanwhile sent on stays free until this replica's next poll."""
    if cfg.gateway_order_s is None or w.others_head_priority is None or queue.since is None:
        return 0
    if w.others_head_priority != request.priority:
        return -1 if w.others_head_priority > request.priority else 1
    ahead = queue.since - w.others_head_since  # > 0: their head came first
    if ahead > cfg.gateway_order_s:
        return -1
    return 1 if ahead < -cfg.gateway_order_s else 0


def queue_capacity(w: WorkerLoad, cfg: AdmissionConfig) -> int:
    """Requests this gateway replica may hold waiting: `queue_max` a replica, pooled across the replicas that share
    the worker (those that told it their queue lately, `other_gateways`, with `gateways_waiting` queued there), so
    that a replica may hold more while the others hold less, up to `queue_max` x replicas in all and never more than
    that alone (the memory bound). Clients' connections fall on the replicas unevenly (SO_REUSEPORT), and closed-loop
    clients re-arrive together once a wave of answers ends: with `queue_max` a replica each, at 1,000 clients over 4
    replicas one replica's queue passed 256 while 616 waited in all (429s on the H200 and, 115 of 4,000, on the
    2-core box with the load-test backend's batch of 256 + 128; BENCHMARKS.md, issue 25)."""
    if w.other_gateways <= 0:
        return cfg.queue_max
    return max(cfg.queue_max, cfg.queue_max * (1 + w.other_gateways) - w.gateways_waiting)


def _queue_or_reject(request: AdmissionRequest, queue: QueueState, cfg: AdmissionConfig, max_tokens: int,
                     w: WorkerLoad):
    pooled = queue_capacity(w, cfg)
    capacity = pooled if request.priority >= 0 else int(pooled * cfg.background_queue_share)
    ahead = queue.ahead_of(request.priority)
    if queue.depth >= capacity:
        return _reject_429(
            f"Workers are at capacity and the queue is full ({queue.depth} waiting)", ahead, queue, cfg
        )
    if queue.drain_rate_per_s > 0 and (ahead + 1) / queue.drain_rate_per_s > cfg.queue_deadline_s:
        # Say no now rather than after the whole deadline: the queue ahead cannot drain in time.
        return _reject_429(
            f"Workers are at capacity; the {ahead} requests ahead would take longer than the "
            f"{cfg.queue_deadline_s:g} s queue deadline", ahead, queue, cfg,
        )
    return AdmissionDecision("queue", deadline_s=cfg.queue_deadline_s, max_tokens=max_tokens)


def _reject_429(reason: str, ahead: int, queue: QueueState, cfg: AdmissionConfig) -> AdmissionDecision:
    retry = retry_after(ahead, queue, cfg)
    return AdmissionDecision(
        "reject", 429, "server_overloaded", f"{reason}; retry after {retry} s.", retry_after_s=retry
    )


def _reject_400(message: str) -> AdmissionDecision:
    return AdmissionDecision("reject", 400, "context_length_exceeded", message)


class DrainRate:
    """Requests per second leaving the queue while requests wait in it, as an exponentially decaying average.

    Pure: the caller passes the clock (`time.monotonic()`), so tests drive it. `busy(now, waiting)` whenever
    the queue turns empty or non-empty; `record(now)` at each departure; `rate(now)` is the rate over roughly
    the last `window_s` seconds of busy time. Only busy time counts, and only departures while someone waits:
    an idle minute decayed a wall-clock average toward zero, and the next burst was then refused at once as a
    queue that could never drain (bench/llama_server_parity, 64 clients after an idle spell).
    """

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._count = 0.0  # decayed number of departures
        self._last: float | None = None  # busy-clock time of the last decay
        self._first: float | None = None  # busy-clock time of the first departure
        self._busy_s = 0.0  # busy seconds before the current busy spell
        self._since: float | None = None  # when the current busy spell began; None while idle

    def busy(self, now: float, waiting: bool) -> None:
        if waiting and self._since is None:
            self._since = now
        elif not waiting and self._since is not None:
            self._busy_s += max(0.0, now - self._since)
            self._since = None

    def record(self, now: float, n: int = 1) -> None:
        if self._since is None:
            return  # nobody was waiting: this departure drained no queue
        self._decay(self._busy_clock(now))
        self._count += n

    def rate(self, now: float) -> float:
        if self._first is None:
            return 0.0
        t = self._busy_clock(now)
        self._decay(t)
        # While fewer than window_s busy seconds have been observed, divide by the time actually seen.
        seen = self.window_s * (1.0 - math.exp(-max(t - self._first, 1e-3) / self.window_s))
        return self._count / seen

    def _busy_clock(self, now: float) -> float:
        return self._busy_s + (max(0.0, now - self._since) if self._since is not None else 0.0)

    def _decay(self, t: float) -> None:
        if self._last is None:
            self._first = self._last = t
            return
        dt = max(0.0, t - self._last)
        self._count *= math.exp(-dt / self.window_s)
        self._last = t


def effective_priority(asked: int | None, key_max: int) -> int:
    """A request's priority: its key's `max_priority`, or less when the request asks for less. Asking
    for more than the key allows is not an error (clients send one value to many servers): it is clamped."""
    return key_max if asked is None else min(asked, key_max)


class FairOrder:
    """Queue order across tenants: `tag` gives each queued request its sort key (lower is served first).

    Higher priority first. Within one priority, start-time fair queueing: each tenant's requests get
    virtual start tags one `cost` apart, beginning at the priority's virtual time (the start tag of the
    last request served), so a tenant with 1,000 queued and a tenant arriving with 1 are served in turns
    rather than first-come. `served` advances the virtual time; `withdrawn` gives back a tag that was
    never served (expired, cancelled) when it was the tenant's last. Pure: no clock, no I/O. Tenants idle
    long enough to fall out of the bounded maps are treated as new, which is what SFQ does with them anyway.
    """

    def __init__(self, max_entries: int = 4096):
        self._finish: cachetools.LRUCache = cachetools.LRUCache(max_entries)  # (priority, tenant) -> last finish tag
        self._vtime: cachetools.LRUCache = cachetools.LRUCache(max_entries)  # priority -> virtual time

    def tag(self, priority: int, tenant: str, cost: float = 1.0) -> tuple[int, float]:
        start = max(self._vtime.get(priority, 0.0), self._finish.get((priority, tenant), 0.0))
        self._finish[(priority, tenant)] = start + cost
        return -priority, start

    def served(self, key: tuple[int, float]) -> None:
        priority, start = -key[0], key[1]
        self._vtime[priority] = max(self._vtime.get(priority, 0.0), start)

    def withdrawn(self, key: tuple[int, float], tenant: str, cost: float = 1.0) -> None:
        priority, start = -key[0], key[1]
        if self._finish.get((priority, tenant)) == start + cost:
            self._finish[(priority, tenant)] = start
