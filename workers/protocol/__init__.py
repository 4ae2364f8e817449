"""The worker contract: wire messages between gateway and worker, and the Backend plug point.

The gateway imports this package and nothing else of `workers`. Messages are msgspec Structs because
they sit on the token hot path (one encode/decode per streamed message).
"""
from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]


GREEDY_BELOW = 1e-5  # a temperature under this samples as greedy (SamplingParams.greedy)


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None  # per-request seed: the same seed and prompt give the same tokens
    # OpenAI's penalties: a token's logit less frequency_penalty x its count in the output so far, less
    # presence_penalty once it has appeared there (the prompt does not count)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        """The most likely token every time: temperature 0, or below GREEDY_BELOW (the division by the
        temperature would overflow float32 logits into inf/NaN, and what such a temperature asks for is the
        argmax; vLLM draws the same line at 1e-5), or top_k 1."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


class GenerateRequest(msgspec.Struct, omit_defaults=True):
    """One generation, already templated and tokenized by the gateway (the worker never re-tokenizes)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = []  # stop strings; the matched text is not returned
    stop_token_ids: list[int] = []  # besides the model's own end-of-turn/EOS ids
    ignore_eos: bool = False
    max_draft_tokens: int | None = None  # lowers the policy's K; 0 disables speculation
    prediction_ids: list[int] | None = None  # OpenAI Predicted Outputs, tokenized
    logprobs: int | None = None  # None: off; N >= 0: chosen token's logprob plus N alternatives
    grammar: str | None = None  # a JSON schema (as JSON text) the output must follow; "{}" = any JSON object
    session_id: str | None = None
    priority: int | None = None  # None: what the API key allows (the gateway sets it before admission)
    tenant: str = ""  # who it is charged to in the admission queue's fair order: the key's id (public)
    trace_context: dict[str, str] = {}  # W3C traceparent/tracestate from the gateway's span
    model: str = ""  # the served model's name: only its workers are sent the request
    # A migrated generation (its first worker died mid-stream): the tokens it had already produced and
    # delivered. The worker continues after prompt_ids + resume_ids as if it had generated them itself:
    # max_tokens, usage, the sampler's token index, stop strings and a grammar all count them, and their
    # text is not sent again.
    resume_ids: list[int] = []


class TokenLogprob(msgspec.Struct, omit_defaults=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # (token id, logprob), best first


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a KV cache
    drafted_tokens: int = 0  # speculation: tokens proposed (prompt lookup and prediction drafts)
    accepted_tokens: int = 0  # speculation: proposed tokens that were kept
    # OpenAI Predicted Outputs: tokens of the given prediction that did / did not appear in the completion
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Chunk(msgspec.Struct, omit_defaults=True):
    """A piece of one generation's output. The last chunk has finish_reason and usage set.

    A backend may put several tokens in one chunk (coalescing). An error after output has started is
    a final chunk with finish_reason "error" and `error` set; before output, `generate` raises
    BackendError instead, so the gateway can still answer with an HTTP status or retry elsewhere.
    """

    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None


class BackendStats(msgspec.Struct):
    """A worker's load, as routing and admission see it."""

    running: int = 0  # sequences generating now
    waiting: int = 0  # sequences queued inside the backend
    slots: int = 1  # sequences it can run at once
    # requests beyond its slots it holds waiting at no cost per step, so a finished sequence's place is refilled
    # inside it (its device profile's worker_queue); None: the gateway's admission.worker_queue_max decides
    queue_max: int | None = None
    # requests waiting in the admission queues of the gateways other than the one asking, as each told this worker
    # in its latest stats poll (workers/stream.py): with several gateway replicas, each takes its share of the places
    gateways_waiting: int = 0
    other_gateways: int = 0  # how many other gateways told it their queue lately: the admission queue is theirs too
    # of the other gateways' queued heads that wait for this worker, the one that goes first across them (highest
    # priority, then waited longest): its priority (None: none waits for it) and how long it has waited by now
    gateways_head_priority: int | None = None
    gateways_head_waited_s: float = 0.0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    block_size: int = 16
    tokens_per_s: float = 0.0  # generated tokens per second, recent
    prefill_tokens_per_s: float = 0.0
    preemptions: int = 0
    restarts: int = 0  # backend process restarts (llama-server)
    healthy: bool = True
    generated_tokens: int = 0  # cumulative since start
    speculation_k: int | None = None  # K of the latest decode step
    steps_by_k: list[int] = []  # cumulative decode steps at each K (index = K)
    drafted_by_position: list[int] = []  # cumulative; index 0 is draft position 1
    accepted_by_position: list[int] = []
    # the speculation gate by concurrency bucket: {"1": {"drafting": bool, "on": tok/s, "off": tok/s}, ...}
    speculation_gate: dict[str, dict] = {}
    # where a new sequence's acceptance starts, by kind: {"('text', sampled, prediction)": [rate by draft position]}
    speculation_prior: dict[str, list[float]] = {}
    # the GPU engine's forwards by path, cumulative: {"graph": n, "verify": n, "eager": n}; eager ones carry a
    # prompt (or a step no graph fits) and cost several graph steps (BENCHMARKS.md, issue 25)
    forwards_by_path: dict[str, int] = {}
    steps_ahead: int = 0  # engine steps launched before the step before them was read (workers.engine.overlap)
    gc_seconds: float = 0.0  # cumulative seconds the cyclic garbage collector ran in the engine's process
    step_seconds: float = 0.0  # cumulative seconds the engine's step thread spent in steps
    token_wait_seconds: float = 0.0  # of them, getting a step's tokens (a device engine: waiting on the device)
    # the step thread's cumulative seconds by part (workers/cupy/engine.py PHASES): {"schedule": s, "build": s, ...}
    step_phase_seconds: dict[str, float] = {}
    attention_settings: dict[str, int] = {}  # the GPU attention kernel's compile-time settings ({}: none)
    gc_frozen: int = 0  # objects frozen out of its collections (workers.engine.quiet_gc); 0: Python's defaults
    pipeline_transport: str = ""  # pipelined engine: how activations move between stages ("" = no pipeline)
    pipeline_transfer_seconds: float = 0.0  # cumulative time moving activations, all hops
    pipeline_transfer_bytes: int = 0  # cumulative
    pipeline_tokens: int = 0  # tokens that crossed the pipeline (per-token cost = seconds / tokens)
    pipeline_rebuilds: int = 0  # times the pipeline rebuilt its stages after losing one (workers/pipeline)


class BlockEvent(msgspec.Struct):
    """KV blocks that appeared in or left a worker's cache, for the prefix index."""

    kind: Literal["added", "evicted"]
    hashes: list[int]
    tier: Literal["gpu", "host", "checkpoint"] = "gpu"


BlockSink = Callable[[BlockEvent], None]


class BlockBatch(msgspec.Struct):
    """GET /blocks?since=N on a worker: its block events after N (workers/blocklog.py)."""

    seq: int  # the last event's number; pass it back as `since`
    reset: bool  # the caller missed events: drop what it knows of this worker first
    events: list[BlockEvent]


class BackendError(Exception):
    """A failure that carries an HTTP-style status and survives process boundaries (picklable)."""

    def __init__(self, message: str, status: int = 503, code: str = "backend_unavailable"):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code

    def __reduce__(self):
        return (type(self), (self.message, self.status, self.code))


class Backend(abc.ABC):
    """What a worker runs: Pulse's CuPy engine, a managed llama-server, or the load-test instrument.

    Contract (one test suite, tests/integration/test_backend_contract.py, runs it against every backend):
    - `start()` returns when the backend can serve; it raises if it cannot.
    - `generate(request)` is an async iterator of Chunks: text deltas in order, then exactly one final
      chunk with `finish_reason` and `usage`. Stop strings are honoured and not returned.
      Before the first chunk it may raise BackendError (no capacity, bad request for this backend).
      Closing the iterator early (client gone) cancels the generation and frees its slot and KV blocks.
    - `cancel(request_id)` does the same from outside; unknown ids are ignored.
    - `health()` is True when a request sent now would be served.
    - `stats()` is cheap and never blocks.
    - `close()` frees the device and any child process; it is safe to call twice.
    Block events (KV blocks added/evicted, by chain hash from cache.hashing) go to the `block_sink`
    given to the constructor, when the backend knows them.
    """

    name: str = "backend"

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]: ...

    @abc.abstractmethod
    async def cancel(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def health(self) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> BackendStats: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class WorkerInfo(msgspec.Struct):
    """How the gateway reaches a worker's token stream (a direct HTTP channel, not a Ray call per chunk)."""

    worker_id: str
    url: str  # e.g. http://127.0.0.1:40123
    backend: str
    node_id: str = ""
    device: str = "cpu"
    # which physical device it computes on, within its node: a GPU's UUID (a MIG slice has its own), "cpu"
    # for the node's cores; workers with the same node_id and device_id share that device's time
    device_id: str = ""
    block_size: int = 16
    context_length: int = 0
    model: str = ""  # the served name of the model it holds ("" : whatever the gateway serves)
    # the root of its model's block-hash chain (cache.hashing.chain_root(...).hash): the router hashes a
    # prompt from it, so lookups name the blocks this worker publishes and never another model's
    prefix_seed: int = 0
    secret: str = ""  # the bearer secret the worker's channel demands (workers/stream.py)

    def __repr__(self) -> str:  # keeps the secret out of logs and tracebacks
        shown = {k: v for k, v in msgspec.structs.asdict(self).items() if k != "secret"}
        return f"WorkerInfo({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


encode = msgspec.json.Encoder().encode
chunk_decoder = msgspec.json.Decoder(Chunk)
request_decoder = msgspec.json.Decoder(GenerateRequest)
stats_decoder = msgspec.json.Decoder(BackendStats)
