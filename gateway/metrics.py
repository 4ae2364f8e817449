"""Prometheus metrics of the gateway, plus every worker's load, on one `/metrics`.

Names start `pulse_` and carry their unit; docs/METRICS.md is the table of them all. The objects live in
a registry passed in (no global state), so tests build their own. Hot-path rules: per-request label
children are looked up once (`GatewayMetrics.request(model)`), per-chunk work is one histogram observe.

Worker metrics are not scraped from each worker process: the gateway already pulls each worker's
BackendStats snapshot for routing, and `WorkerStatsCollector` turns the latest snapshots into
`pulse_worker_*` series at scrape time.

Several gateway replicas on one box: set PROMETHEUS_MULTIPROC_DIR (an empty directory, the same for
every replica, before prometheus_client is imported) and `render()` aggregates all replicas' counters
and histograms, so one scrape of any replica shows the whole node.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Buckets in seconds. TTFT spans a cached 1 ms hit to a cold multi-minute prefill (Thor: ~2 min for 12k).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                    320.0, 640.0, 1280.0)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

OTHER_MODEL = "other"  # label for models past `max_models`: clients choose model names, cap the series


class GatewayMetrics:
    """The gateway's metric objects, registered in `registry` (a fresh one if not given)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        worker_snapshots: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        max_models: int = 32,
    ):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.max_models = max_models
        self._models: dict[str, ModelMetrics] = {}
        self._rejections: dict[str, Any] = {}
        r = self.registry
        self.requests = Counter("pulse_requests", "Requests finished, by model, API and HTTP status.",
                                ["model", "api", "status"], registry=r)
        self.ttft = Histogram("pulse_time_to_first_token_seconds", "Request arrival to the first streamed token.",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pulse_inter_token_latency_seconds",
                             "Gap between streamed chunks divided by the tokens in the chunk.",
                             ["model"], buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("pulse_request_duration_seconds", "Request arrival to its last byte.",
                                  ["model"], buckets=DURATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pulse_prompt_tokens", "Prompt tokens of finished requests.", ["model"], registry=r)
        self.cached_tokens = Counter("pulse_cached_prompt_tokens", "Prompt tokens served from a KV cache.",
                                     ["model"], registry=r)
        self.generated_tokens = Counter("pulse_generated_tokens", "Tokens generated (completion tokens).",
                                        ["model"], registry=r)
        self.drafted_tokens = Counter("pulse_draft_tokens_drafted", "Speculative draft tokens proposed.",
                                      ["model"], registry=r)
        self.accepted_tokens = Counter("pulse_draft_tokens_accepted", "Speculative draft tokens accepted.",
                                       ["model"], registry=r)
        # livesum: with several replicas (multiprocess mode) the node's value is the sum over live ones.
        self.queue_depth = Gauge("pulse_queue_depth", "Requests admitted by the gateway, waiting for a worker.",
                                 registry=r, multiprocess_mode="livesum")
        self.in_flight = Gauge("pulse_requests_in_flight", "Requests being served now.",
                               registry=r, multiprocess_mode="livesum")
        self.rejections = Counter("pulse_admission_rejections", "Requests refused by admission, by reason.",
                                  ["reason"], registry=r)
        self.route_time = Histogram("pulse_router_decision_seconds", "Time to choose a worker (pure policy).",
                                    buckets=DECISION_BUCKETS, registry=r)
        self.route_cpu = Histogram("pulse_router_decision_cpu_seconds",
                                   "CPU time of one routing decision on the gateway's thread: hashing the prompt, "
                                   "worker loads and the policy (no index round trip, no time preempted).",
                                   buckets=DECISION_BUCKETS, registry=r)
        self.prefix_lookup_time = Histogram("pulse_prefix_lookup_seconds", "Prefix index lookup, one round trip.",
                                            buckets=DECISION_BUCKETS, registry=r)
        self.prefix_hit_ratio = Histogram("pulse_prefix_hit_ratio",
                                          "Per request: prompt tokens found in the prefix index / prompt tokens.",
                                          buckets=RATIO_BUCKETS, registry=r)
        self.migrations = Counter("pulse_stream_migrations",
                                  "Streams whose worker failed mid-generation, by outcome: resumed on another "
                                  "worker, or failed (the client got one error event).", ["outcome"], registry=r)
        self.workers = WorkerStatsCollector(worker_snapshots if worker_snapshots is not None else {})
        r.register(self.workers)

    # --- per request ---------------------------------------------------------------------------

    def model(self, name: str) -> ModelMetrics:
        """Label children bound to one model, made once and cached (at most `max_models` names)."""
        mm = self._models.get(name)
        if mm is None:
            if len(self._models) >= self.max_models and name != OTHER_MODEL:
                return self.model(OTHER_MODEL)
            mm = self._models[name] = ModelMetrics(self, name)
        return mm

    def request(self, model: str, start: float | None = None, *, api: str = "chat") -> RequestMetrics:
        """Start timing one request (counts it in flight). Call `.chunk(n)` per streamed chunk and
        `.finish(status, usage)` once at the end, in a `finally`. `start` is a time.perf_counter();
        `api` the endpoint's protocol (chat, completions, responses, messages: a fixed word, not client input)."""
        return RequestMetrics(self.model(model), self.in_flight, start, api)

    def record_request(self, model: str, status: int | str, duration_s: float, usage: Any = None,
                       ttft_s: float | None = None, *, api: str = "chat") -> None:
        """One-shot record of a request timed elsewhere (non-streamed, or refused before a worker)."""
        mm = self.model(model)
        if ttft_s is not None:
            mm.ttft.observe(ttft_s)
        mm.finish(status, duration_s, usage, api)

    # --- gateway decisions -----------------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        """Count one admission rejection; `reason` is a short fixed word (quota, auth, overload, ...)."""
        child = self._rejections.get(reason)
        if child is None:
            child = self._rejections[reason] = self.rejections.labels(reason=reason)
        child.inc()

    def migrated(self, outcome: str) -> None:
        """One mid-stream worker failure: `outcome` "resumed" (on another worker) or "failed"."""
        self.migrations.labels(outcome=outcome).inc()

    def routed(self, seconds: float, cpu_seconds: float | None = None) -> None:
        """`seconds`: wall time of the route step (lookup included); `cpu_seconds`: the decision's own CPU."""
        self.route_time.observe(seconds)
        if cpu_seconds is not None:
            self.route_cpu.observe(cpu_seconds)

    def prefix_lookup(self, seconds: float, matched_tokens: int, prompt_tokens: int) -> None:
        """One prefix-index lookup: its time, and the share of the prompt it found cached somewhere."""
        self.prefix_lookup_time.observe(seconds)
        if prompt_tokens > 0:
            self.prefix_hit_ratio.observe(min(matched_tokens / prompt_tokens, 1.0))

    # --- exposition ------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            registry.register(self.workers)  # worker snapshots: this replica's view is the whole view
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ModelMetrics:
    """The label children of one model (looked up once, so the hot path never builds label dicts)."""

    __slots__ = ("name", "ttft", "itl", "duration", "prompt", "cached", "generated", "drafted", "accepted",
                 "_requests", "_by_status")

    def __init__(self, parent: GatewayMetrics, name: str):
        self.name = name
        self.ttft = parent.ttft.labels(model=name)
        self.itl = parent.itl.labels(model=name)
        self.duration = parent.duration.labels(model=name)
        self.prompt = parent.prompt_tokens.labels(model=name)
        self.cached = parent.cached_tokens.labels(model=name)
        self.generated = parent.generated_tokens.labels(model=name)
        self.drafted = parent.drafted_tokens.labels(model=name)
        self.accepted = parent.accepted_tokens.labels(model=name)
        self._requests = parent.requests
        self._by_status: dict[str, Any] = {}

    def finish(self, status: int | str, duration_s: float, usage: Any = None, api: str = "chat") -> None:
        key = (api, str(status))
        child = self._by_status.get(key)
        if child is None:
            child = self._by_status[key] = self._requests.labels(model=self.name, api=api, status=key[1])
        child.inc()
        self.duration.observe(duration_s)
        if usage is not None:
            self.prompt.inc(usage.prompt_tokens)
            self.cached.inc(usage.cached_tokens)
            self.generated.inc(usage.completion_tokens)
            if usage.drafted_tokens:
                self.drafted.inc(usage.drafted_tokens)
                self.accepted.inc(usage.accepted_tokens)


class RequestMetrics:
    """Timing of one request: TTFT on the first chunk, inter-token latency on each later one."""

    __slots__ = ("_mm", "_in_flight", "api", "start", "last", "first_token_s", "done", "tokens")

    def __init__(self, mm: ModelMetrics, in_flight: Gauge, start: float | None = None, api: str = "chat"):
        self._mm, self._in_flight, self.api = mm, in_flight, api
        self.start = self.last = start if start is not None else time.perf_counter()
        self.first_token_s: float | None = None
        self.done = False
        self.tokens = 0  # tokens relayed so far (for quota accounting when a stream is cut short)
        in_flight.inc()

    def chunk(self, n_tokens: int = 1, now: float | None = None) -> None:
        """A streamed chunk carrying `n_tokens` tokens left the gateway."""
        now = now if now is not None else time.perf_counter()
        self.tokens += n_tokens
        if self.first_token_s is None:
            self.first_token_s = now - self.start
            self._mm.ttft.observe(self.first_token_s)
        elif n_tokens > 0:
            self._mm.itl.observe((now - self.last) / n_tokens)
        self.last = now

    def finish(self, status: int | str, usage: Any = None, now: float | None = None) -> None:
        """Record the outcome once (later calls are ignored). `status`: the HTTP status sent, or
        "stream_error" when a stream that had started ended with an in-band error."""
        if self.done:
            return
        self.done = True
        now = now if now is not None else time.perf_counter()
        self._mm.finish(status, now - self.start, usage, self.api)
        self._in_flight.dec()


# --- worker snapshots -> pulse_worker_* ----------------------------------------------------------

# (metric, help, snapshot field) for plain per-worker gauges; BackendStats fields (workers/protocol).
_WORKER_GAUGES = (
    ("pulse_worker_running_sequences", "Sequences generating now.", "running"),
    ("pulse_worker_waiting_sequences", "Sequences queued inside the worker's backend.", "waiting"),
    ("pulse_worker_slots", "Sequences the backend can run at once.", "slots"),
    ("pulse_worker_kv_blocks_used", "KV cache blocks in use.", "kv_blocks_used"),
    ("pulse_worker_generated_tokens_per_second", "Generated tokens per second, recent.", "tokens_per_s"),
    ("pulse_worker_prefill_tokens_per_second", "Prompt tokens processed per second, recent.", "prefill_tokens_per_s"),
    ("pulse_worker_speculation_k", "Draft depth K chosen for the latest decode step (0: off).", "speculation_k"),
)
# (metric without _total, help, snapshot field) for cumulative counts kept by the worker.
_WORKER_COUNTERS = (
    ("pulse_worker_preemptions", "Sequences preempted (KV blocks reclaimed) since the worker started.", "preemptions"),
    ("pulse_worker_backend_restarts", "Backend process restarts (llama-server) since the worker started.", "restarts"),
    ("pulse_worker_generated_tokens", "Tokens generated since the worker started.", "generated_tokens"),
    ("pulse_worker_engine_steps_ahead", "Engine steps launched before the step before them was read (overlap).",
     "steps_ahead"),
    ("pulse_worker_engine_step_seconds", "Time the engine's step thread spent in steps.", "step_seconds"),
    ("pulse_worker_engine_token_wait_seconds", "Of the engine's step time, getting each step's tokens (a GPU engine: "
     "waiting for the device).", "token_wait_seconds"),
    ("pulse_worker_pipeline_transfer_seconds", "Time a pipelined engine spent moving activations between stages.",
     "pipeline_transfer_seconds"),
    ("pulse_worker_pipeline_transfer_bytes", "Activation bytes moved between pipeline stages.",
     "pipeline_transfer_bytes"),
    ("pulse_worker_pipeline_tokens", "Tokens that crossed a pipelined engine's stages.", "pipeline_tokens"),
    ("pulse_worker_pipeline_rebuilds", "Times a pipelined engine rebuilt its stages after losing one.",
     "pipeline_rebuilds"),
)
# (metric without _total, help, snapshot field, label): lists indexed by draft position (1-based) or K.
_WORKER_VECTORS = (
    ("pulse_worker_draft_tokens_drafted", "Draft tokens proposed, by position in the draft.",
     "drafted_by_position", "position"),
    ("pulse_worker_draft_tokens_accepted", "Draft tokens accepted, by position in the draft.",
     "accepted_by_position", "position"),
    ("pulse_worker_speculation_steps", "Decode steps run at each draft depth K.", "steps_by_k", "k"),
)


def _field(snapshot: Any, name: str) -> Any:
    if isinstance(snapshot, Mapping):
        return snapshot.get(name)
    return getattr(snapshot, name, None)


class WorkerStatsCollector:
    """Exports the gateway's latest worker snapshots as `pulse_worker_*` series, labelled `worker`.

    `snapshots` is a mapping worker_id -> snapshot (a BackendStats, or any object/dict with its field
    names), or a callable returning one; it is read at scrape time, so the gateway just keeps it current.
    Fields a snapshot lacks (e.g. the speculation ones on a backend without a drafter) are skipped.
    Counters come from the worker's own cumulative counts; a worker restart resets them, which
    Prometheus' rate() handles as a counter reset.
    """

    def __init__(self, snapshots: Mapping[str, Any] | Callable[[], Mapping[str, Any]]):
        self._snapshots = snapshots

    def describe(self) -> list:
        return self._families()

    def _families(self) -> list:
        fams = [GaugeMetricFamily(n, h, labels=["worker"]) for n, h, _ in _WORKER_GAUGES]
        fams.append(GaugeMetricFamily("pulse_worker_kv_blocks_free", "KV cache blocks free.", labels=["worker"]))
        fams.append(GaugeMetricFamily("pulse_worker_healthy", "1 if the backend would serve a request now.",
                                      labels=["worker"]))
        fams.append(GaugeMetricFamily("pulse_worker_pipeline_transport", "1 for the transport a pipelined engine's "
                                      "stages use (shm, tcp-loopback, tcp).", labels=["worker", "transport"]))
        fams += [CounterMetricFamily(n, h, labels=["worker"]) for n, h, _ in _WORKER_COUNTERS]
        fams += [CounterMetricFamily(n, h, labels=["worker", lab]) for n, h, _, lab in _WORKER_VECTORS]
        fams.append(CounterMetricFamily("pulse_worker_engine_forwards", "GPU engine forwards by path: graph (a "
                                        "decode step's CUDA graph), verify (a speculative verify graph), eager "
                                        "(a step carrying prompt tokens).", labels=["worker", "path"]))
        return fams

    def collect(self):
        snaps = self._snapshots() if callable(self._snapshots) else self._snapshots
        fams = self._families()
        by_name = {f.name: f for f in fams}
        for worker, snap in list(snaps.items()):  # copy: the gateway may replace entries meanwhile
            for name, _, field in _WORKER_GAUGES:
                value = _field(snap, field)
                if value is not None:
                    by_name[name].add_metric([worker], float(value))
            total, used = _field(snap, "kv_blocks_total"), _field(snap, "kv_blocks_used")
            if total is not None and used is not None:
                by_name["pulse_worker_kv_blocks_free"].add_metric([worker], float(max(total - used, 0)))
            healthy = _field(snap, "healthy")
            if healthy is not None:
                by_name["pulse_worker_healthy"].add_metric([worker], 1.0 if healthy else 0.0)
            transport = _field(snap, "pipeline_transport")
            if transport:
                by_name["pulse_worker_pipeline_transport"].add_metric([worker, transport], 1.0)
            for name, _, field in _WORKER_COUNTERS:
                value = _field(snap, field)
                if value is not None:
                    by_name[name].add_metric([worker], float(value))
            for name, _, field, label in _WORKER_VECTORS:
                # positions are 1-based (first draft token = position 1); K starts at 0 (no drafting)
                offset = 1 if label == "position" else 0
                for i, value in enumerate(_field(snap, field) or ()):
                    by_name[name].add_metric([worker, str(i + offset)], float(value))
            for path, value in (_field(snap, "forwards_by_path") or {}).items():
                by_name["pulse_worker_engine_forwards"].add_metric([worker, path], float(value))
        return fams
