"""EngineBackend: the worker's Backend on Pulse's own engine (NumPy on a CPU box, CuPy on a GPU).

The engine steps in one dedicated thread (workers/cupy/engine_loop.py; NumPy and CuPy release the GIL in their
heavy calls, so the asyncio loop stays responsive). Requests and cancellations reach it through a queue it drains
between steps; its outputs come back to the event loop in one call per hand-over, which gives each to its
request's inbox. Detokenizing and stop strings happen on the asyncio side, per request, so the step loop only
deals in token ids.

Where the step thread runs: in this process, or (`workers.engine.process`; by default wherever the engine is on
a GPU) in an engine process of its own (workers/cupy/engine_process.py), so that the step thread and this event
loop do not take turns on one GIL. Everything above the step thread is the same in both.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator

import msgspec
import numpy as np

from workers.cupy.device import array_module, cuda_available, device_name
from workers.cupy.drafter import prediction_usage
from workers.cupy.engine import Engine, StepOutput, create_engine
from workers.cupy.engine_loop import (
    HANDOVER_S_PER_STREAM,
    STOP,
    EngineLoop,
    engine_snapshot,
    handover_due,
    pipeline_stats,
)
from workers.cupy.engine_process import builder
from workers.cupy.weights import load_weights
from workers.protocol import (
    Backend,
    BackendError,
    BackendStats,
    BlockSink,
    Chunk,
    GenerateRequest,
    Usage,
)
from workers.protocol.detok import IncrementalDetokenizer, StopMatcher, TokenTexts
from workers.protocol.model import load_tokenizer

log = logging.getLogger(__name__)
_decode_outputs = msgspec.msgpack.Decoder(list[StepOutput]).decode  # an engine process's hand-overs

__all__ = ["EngineBackend", "HANDOVER_S_PER_STREAM", "build_engine", "handover_due"]


def build_engine(config, profile, info, block_sink: BlockSink | None = None):
    """The worker's engine from its config, device profile and model: NumPy or CuPy (or pipeline stages), with
    grammar support and the profile's speculation. Module-level so an engine process can call it by name."""
    cfg = config.workers.engine
    xp = array_module(cfg.device)
    sizes = engine_sizes(config, profile, info)
    weights = load_weights(info.path, cfg.cache_dir)
    log.info("engine on %s: %s", device_name(xp), sizes)
    if cfg.pipeline_stages > 1 or cfg.stages:  # layers in stage actors
        from workers.pipeline.build import build_for_backend

        if xp is np:
            _limit_blas_threads(cfg.cpu_threads)
        engine = build_for_backend(info, weights, cfg, xp, sizes, block_sink, config.server.ray_address is not None)
    elif xp is np:
        _limit_blas_threads(cfg.cpu_threads)
        engine = create_engine(info, weights, xp, block_sink=block_sink, **sizes)
    else:  # the GPU engine: fused kernels, cuBLAS in graphs, decode as CUDA graphs (workers/cupy/gpu)
        from workers.cupy.gpu import create_gpu_engine

        eager = {} if cfg.cuda_graphs else {"graph_sizes": (), "verify_sizes": ()}  # every step launched eagerly
        engine = create_gpu_engine(info, weights, block_sink=block_sink, **sizes, **eager)
        engine.model.mixed_graphs = cfg.mixed_graphs
        engine.fit_graphs = cfg.fit_graphs
    engine.device_name = device_name(xp)
    # the pipeline's stages step in an engine of their own (workers/pipeline); a CPU engine draws on the host
    # before the next step can start, so overlap only adds its bookkeeping there
    engine.overlap = cfg.overlap == "on" or (cfg.overlap == "auto" and xp is not np and not (
        cfg.pipeline_stages > 1 or cfg.stages))
    wait = cfg.prefill_wait_steps
    engine.scheduler.prefill_wait_steps = profile.prefill_wait_steps if wait is None else wait
    engine.constraints = _constraints(load_tokenizer(info.path), info, xp)
    if cfg.speculation:
        from workers.cupy.speculative import Speculator

        engine.speculator = Speculator(profile, gate=profile.speculation_gate)
    if hasattr(engine.model, "capture_graphs"):  # the GPU engine (not pipeline stages): graphs before "ready"
        t0 = time.perf_counter()
        engine.model.capture_graphs(engine.kv, sizes["block_size"], verify=engine.speculator is not None)
        log.info("engine graphs captured in %.1f s", time.perf_counter() - t0)
    return engine


def engine_sizes(config, profile, info) -> dict:
    """Sizes from the engine config first and the device profile second."""
    cfg = config.workers.engine
    return {
        "block_size": cfg.block_size,
        "num_blocks": cfg.kv_blocks or math.ceil(profile.kv_cache_tokens / cfg.block_size),
        "max_num_seqs": cfg.max_num_seqs or profile.max_num_seqs,
        "max_step_tokens": cfg.max_prefill_tokens,
        "context_length": _context_length(config, profile, info),
        "window_pool": cfg.window_pool,
    }


def _context_length(config, profile, info) -> int:
    return min(x for x in (info.context_length, profile.context_length, config.model.context_length) if x)


def engine_in_process_of_its_own(cfg) -> bool:
    """`workers.engine.process`: true/false as set; auto: where the engine is on a GPU (a CPU engine computes
    with the GIL released nearly all the time, and a second process would only add its start-up) and not split
    into pipeline stages (their actors are started and recovered from the worker's Ray context)."""
    if cfg.pipeline_stages > 1 or cfg.stages:
        return False
    if cfg.process != "auto":
        return cfg.process == "on"
    return cfg.device == "cuda" or (cfg.device == "auto" and cuda_available())


class EngineBackend(Backend):
    name = "cupy"
    # what builds the engine, by name, and its arguments before block_sink (an engine process calls it)
    engine_builder = "workers.cupy.backend:build_engine"

    def __init__(self, config, profile, model, block_sink: BlockSink | None = None, worker_id: str = "w0"):
        self._config, self._profile, self._info = config, profile, model
        self._engine_cfg = config.workers.engine
        self._block_sink, self.worker_id = block_sink, worker_id
        self._engine: Engine | None = None  # in this process; None with an engine process
        self._core: EngineLoop | None = None
        self._proc = None  # workers.cupy.engine_process.EngineProcess
        self._inbox = None  # where adds and aborts go: the step thread's queue, or the engine process
        self._snapshot: dict = {}  # the engine process's last stats
        self._asked: dict[int, asyncio.Future] = {}  # questions to the engine process, by token
        self._tokens = itertools.count()
        self._restarting: asyncio.Future | None = None
        self._tokenizer = None
        self._streams: dict[str, _Inbox] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._healthy = False
        self.device = "cpu"

    @property
    def context_length(self) -> int:
        return _context_length(self._config, self._profile, self._info)

    @property
    def block_size(self) -> int:
        return self._engine_cfg.block_size

    @property
    def in_engine_process(self) -> bool:
        return self._proc is not None

    @property
    def hold_s_per_stream(self) -> float:
        """How long the step thread holds step outputs per stream before a hand-over (EngineLoop)."""
        return self._engine_cfg.handover_us_per_stream * 1e-6

    def engine_builder_args(self) -> tuple:
        return (self._config, self._profile, self._info)

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._engine is not None or self._proc is not None:
            return
        self._loop = asyncio.get_running_loop()
        if engine_in_process_of_its_own(self._engine_cfg):
            await self._start_process()
        else:
            self._engine, self._tokenizer = await asyncio.to_thread(self._build)
            self.device = getattr(self._engine, "device_name", self.device)
            self._core = EngineLoop(self._engine, emit=self._emit, emit_one=self._emit_one,
                                    on_health=self._set_health, hold_s_per_stream=self.hold_s_per_stream)
            self._inbox = self._core.inbox
            self._thread = threading.Thread(target=self._core.run, name=f"engine-{self.worker_id}", daemon=True)
            self._thread.start()
        self._texts = TokenTexts(self._tokenizer)
        self._healthy = True

    def _build(self):
        engine = builder(self.engine_builder)(*self.engine_builder_args(), block_sink=self._block_sink)
        return engine, load_tokenizer(self._info.path)

    async def _start_process(self) -> None:
        from workers.cupy.engine_process import EngineProcess

        spec = {"builder": self.engine_builder, "args": self.engine_builder_args(),
                "hold_s_per_stream": self.hold_s_per_stream, "quiet_gc": self._engine_cfg.quiet_gc}
        proc = EngineProcess(spec, on_message=self._on_engine_message, on_lost=self._on_engine_lost)
        self.device = await asyncio.to_thread(proc.start)
        self._proc = proc
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self._info.path)
        self._inbox = _ProcessInbox(proc)
        log.info("engine process %d on %s", proc.proc.pid, self.device)

    # the step thread's hand-overs, in this process
    def _emit(self, outputs: list) -> None:
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _emit_one(self, request_id: str, item) -> None:
        self._loop.call_soon_threadsafe(self._deliver_one, request_id, item)

    def _set_health(self, healthy: bool) -> None:
        self._healthy = healthy

    # the engine process's messages, on its reader thread
    def _on_engine_message(self, msg) -> None:
        kind = msg[0]
        if kind == "out":
            self._loop.call_soon_threadsafe(self._deliver, _decode_outputs(msg[1]))
        elif kind == "stats":
            self._snapshot = msg[1]
        elif kind == "one":
            self._loop.call_soon_threadsafe(self._deliver_one, msg[1], msg[2])
        elif kind == "block":
            if self._block_sink is not None:
                self._block_sink(msg[1])
        elif kind == "reply":
            self._loop.call_soon_threadsafe(self._reply, *msg[1:])
        elif kind == "health":
            self._healthy = msg[1]

    def _on_engine_lost(self, message: str) -> None:
        log.error("worker %s: %s; starting another", self.worker_id, message)
        self._healthy = False
        self._loop.call_soon_threadsafe(self._engine_lost, message)

    def _engine_lost(self, message: str) -> None:
        """Its streams end with an error (the gateway moves them to another worker where it can); a new engine
        process starts, and the worker is healthy again once its engine is built."""
        self._snapshot = {}
        self._fail_streams(message)
        if self._proc is not None and (self._restarting is None or self._restarting.done()):
            self._restarting = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        await asyncio.to_thread(self._proc.kill)
        try:
            await self._start_process()
        except Exception:
            log.exception("worker %s: the engine process could not be restarted", self.worker_id)
            return  # stays unhealthy: the gateway routes elsewhere
        self._healthy = True

    def _fail_streams(self, message: str) -> None:
        for inbox in list(self._streams.values()):
            inbox.put(RuntimeError(message))
        for future in self._asked.values():
            if not future.done():
                future.set_exception(BackendError(message, 503))

    async def close(self) -> None:
        self._healthy = False
        if self._restarting is not None:
            self._restarting.cancel()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._inbox.put((STOP, None))
            await asyncio.to_thread(thread.join)
        proc, self._proc = self._proc, None
        if proc is not None:
            await asyncio.to_thread(proc.close)
        if getattr(self._engine, "pipeline_actors", None):
            from workers.pipeline.build import close_pipeline

            await asyncio.to_thread(close_pipeline, self._engine)
        for inbox in list(self._streams.values()):
            inbox.put(BackendError("the engine was closed", 503))
        self._engine = None

    async def health(self) -> bool:
        if self._proc is not None:
            return self._healthy and self._proc.proc.poll() is None
        return self._healthy and self._thread is not None and self._thread.is_alive()

    async def cancel(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def snapshot(self) -> dict | None:
        """The engine's stats fields: read now in this process, the last report from an engine process."""
        if self._proc is not None:
            return self._snapshot
        return None if self._engine is None else engine_snapshot(self._engine)

    def stats(self) -> BackendStats:
        snap = self.snapshot()
        if not snap:
            return BackendStats(healthy=False, block_size=self.block_size)
        return BackendStats(**snap, healthy=self._healthy, queue_max=self._profile.worker_queue)

    def pipeline_stats(self) -> dict | None:
        """The pipeline's transport, bytes and transfer time per token (workers/pipeline); None without one."""
        return pipeline_stats(self._engine)

    async def prepare_grammar(self, schema_text: str) -> None:
        """Compile (or find cached) a grammar before its request reaches the step thread, off that thread;
        BackendError (400: it cannot be compiled; 503: the grammar index is not ready)."""
        if self._proc is None:
            await asyncio.to_thread(compile_grammar, self._engine, schema_text)
        else:
            await self._ask("grammar", schema_text)

    async def cached_blocks(self) -> dict[str, list[int]]:
        """Every block the engine holds, by tier (all on the device): the prefix index's snapshots start from it
        (workers/actor.py). Without it a snapshot would be empty and wipe the worker's entries in Redis."""
        if self._proc is not None:
            return {"gpu": await self._ask("blocks")}
        if self._engine is None:
            return {"gpu": []}
        return {"gpu": self._engine.blocks.cached_hashes()}

    async def _ask(self, kind: str, *args):
        """A question to the engine process and its answer (the error it answers with is raised here)."""
        token = next(self._tokens)
        future = self._asked[token] = self._loop.create_future()
        try:
            self._inbox.put((kind, token, *args))
            return await future
        finally:
            self._asked.pop(token, None)

    def _reply(self, token: int, value, error: BaseException | None) -> None:
        future = self._asked.get(token)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """A step's outputs, on the event loop: each to its request's inbox (none: the request has ended)."""
        streams = self._streams
        for out in outputs:
            inbox = streams.get(out.request_id)
            if inbox is not None:
                inbox.put(out)

    def _deliver_one(self, request_id: str, item) -> None:
        inbox = self._streams.get(request_id)
        if inbox is not None:
            inbox.put(item)

    # --- one request -------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        if self._inbox is None or not self._healthy:
            raise BackendError("the engine is not running", 503)
        if request.max_tokens < 1:
            raise BackendError("max_tokens must be at least 1", 400, "invalid_request_error")
        if request.request_id in self._streams:
            raise BackendError(f"request id {request.request_id!r} is already running", 400,
                               "invalid_request_error")
        if request.grammar is not None:  # compile off the engine thread (cached per schema) so steps never wait
            await self.prepare_grammar(request.grammar)
        stream = _ChunkStream(request, _Inbox(self._loop), self._tokenizer, self._texts, self._inbox)
        if stream.stop.stopped:  # the resumed tokens already end in a stop string: nothing left to generate
            yield stream.stopped_on_resume()
            return
        self._streams[request.request_id] = stream.outputs
        self._inbox.put(("add", request))
        done = False
        try:
            async for chunk in stream.chunks():
                done = chunk.finish_reason is not None
                yield chunk
        finally:
            self._streams.pop(request.request_id, None)
            if not done:  # the consumer left early (client gone): free the slot and its KV blocks
                self._inbox.put(("abort", request.request_id))


class _Inbox:
    """One request's engine outputs (and errors) on the event loop, until its stream takes them all at once.

    Cheaper than an asyncio.Queue on the per-token path: a list and at most one waiter, made on the loop it
    was given (asyncio.get_running_loop() costs a getpid call each time)."""

    __slots__ = ("items", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.items: list = []
        self.loop = loop
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list:
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class _ChunkStream:
    """Engine outputs of one request -> Chunks: detokenized, stop strings cut, several tokens coalesced."""

    def __init__(self, request: GenerateRequest, outputs: _Inbox, tokenizer, texts: TokenTexts, inbox):
        """`inbox`: where an abort goes (the step thread's queue, or _ProcessInbox to an engine process)."""
        self.request, self.outputs, self.inbox = request, outputs, inbox
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_ids, texts)
        self.stop = StopMatcher(request.stop)
        self.started = False
        self.pending_ids: list[int] = []
        self.generated: list[int] = []  # every token so far, for the prediction's usage
        self.pending_lp: list = []
        for token in request.resume_ids:  # a migrated generation: rebuild the text state its first worker had
            self._take_resumed(token)

    def _take_resumed(self, token: int) -> None:
        """One already-delivered token through the detokenizer and stop matcher, token by token as the first
        worker pushed them, so a stop string straddling the hand-over still matches and held-back text is
        released later; what they emit now was already sent."""
        self.generated.append(token)
        self.stop.push(self.detok.push([token]))

    def stopped_on_resume(self) -> Chunk:
        n = len(self.request.resume_ids)
        usage = Usage(prompt_tokens=len(self.request.prompt_ids), completion_tokens=n)
        return self._chunk("", "stop", usage)

    async def chunks(self) -> AsyncIterator[Chunk]:
        while True:
            items = await self.outputs.take()  # all that piled up while the consumer was busy: one chunk
            text, last = "", None
            for item in items:
                if isinstance(item, BaseException):
                    if not self.started and isinstance(item, BackendError):
                        raise item
                    yield Chunk(finish_reason="error", error=str(item), usage=self._usage(last))
                    return
                last = item
                text += self._take(item)
                if self.stop.stopped or item.finish_reason:
                    break
            final = self._final_reason(last)
            if final:
                if final != "stop" or not self.stop.stopped:
                    text += self.stop.flush()
                yield self._chunk(text, final, self._usage(last))
                return
            if text:
                yield self._chunk(text)

    def _take(self, out: StepOutput) -> str:
        self.pending_ids += out.token_ids
        self.generated += out.token_ids
        if out.logprobs:
            self.pending_lp += out.logprobs
        return self.stop.push(self.detok.push(out.token_ids)) if out.token_ids else ""

    def _final_reason(self, out: StepOutput | None) -> str | None:
        if self.stop.stopped:
            if out is not None and not out.finish_reason:
                self.inbox.put(("abort", self.request.request_id))
            return "stop"
        return out.finish_reason if out is not None else None

    def _chunk(self, text: str, finish_reason=None, usage=None) -> Chunk:
        self.started = True
        lp = self.pending_lp if self.request.logprobs is not None else None
        chunk = Chunk(text=text, token_ids=self.pending_ids, logprobs=lp, finish_reason=finish_reason, usage=usage)
        self.pending_ids, self.pending_lp = [], []
        return chunk

    def _usage(self, out: StepOutput | None) -> Usage:
        if out is None:
            return Usage(prompt_tokens=len(self.request.prompt_ids))
        accepted, rejected = prediction_usage(self.request.prediction_ids or [], self.generated)
        return Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                     cached_tokens=out.cached_tokens, drafted_tokens=out.drafted_tokens,
                     accepted_tokens=out.accepted_tokens, accepted_prediction_tokens=accepted,
                     rejected_prediction_tokens=rejected)


def _constraints(tokenizer, info, xp):
    """Grammar support for the engine (its vocabulary index builds in the background from here on)."""
    from workers.cupy.constrain import Constraints, GrammarCompiler

    return Constraints(GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids), xp)


def compile_grammar(engine: Engine, schema_text: str) -> None:
    """`engine.constraints` compiles (or finds cached) `schema_text`: blocking, so off the step thread (in a
    worker thread, here or in the engine process). BackendError 400 when it cannot be compiled, 503 while the
    grammar's vocabulary index is not ready."""
    from workers.cupy.constrain import GrammarError

    try:
        engine.constraints.compiler.prepare(schema_text)
    except GrammarError as exc:
        raise BackendError(f"the grammar cannot be compiled: {exc}", 400, "invalid_request_error") from None
    except RuntimeError as exc:
        raise BackendError(str(exc), 503) from None


class _ProcessInbox:
    """Adds and aborts to the engine process, as the step thread's queue takes them in one process."""

    __slots__ = ("proc",)

    def __init__(self, proc):
        self.proc = proc

    def put(self, item) -> None:
        try:
            self.proc.send(item)
        except (OSError, ValueError):  # the engine process is gone: its reader fails the streams
            pass


def _limit_blas_threads(threads: int | None) -> None:
    """Cap the BLAS pool for this process: on a 2-core box shared with the gateway and Ray, OpenBLAS'
    spinning threads made a decode step several times slower than one thread did."""
    if threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=threads, user_api="blas")
