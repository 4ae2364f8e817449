"""EngineBackend: the worker's Backend on Pulse's own engine (NumPy on a CPU box, CuPy on a GPU).

The engine steps in one dedicated thread (NumPy and CuPy release the GIL in their heavy calls, so the
asyncio loop stays responsive). Requests and cancellations reach it through a queue it drains between
steps; its outputs come back to the event loop in one call_soon_threadsafe per hand-over, which gives each
to its request's inbox. Detokenizing and stop strings happen on the asyncio side, per request, so the step
loop only deals in token ids.

Under load the step thread holds outputs back for a few steps and hands them over together (see
HANDOVER_S_PER_STREAM): every hand-over wakes each running request's task and costs one write on its stream,
all under the GIL that the step thread needs between device steps, so at 64 streams handing over every step
left the engine waiting for the event loop. A request's first token is handed over at once.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator

import numpy as np

from workers.cupy.device import array_module, device_name
from workers.cupy.drafter import prediction_usage
from workers.cupy.engine import Engine, StepOutput, create_engine
from workers.cupy.weights import load_weights
from workers.protocol import Backend, BackendError, BackendStats, BlockSink, Chunk, GenerateRequest, Usage
from workers.protocol.detok import IncrementalDetokenizer, StopMatcher, TokenTexts
from workers.protocol.model import load_tokenizer

log = logging.getLogger(__name__)

_STOP = object()
# How long the step thread may hold step outputs before handing them to the event loop, per stream that has
# output in the step: up to 32 streams hand over every step of 1.6 ms or more, 64 streams every second 1.9 ms
# step (3.2 ms), 256 every seventh (12.8 ms). A stream's wake-up, chunk and write cost the event loop ~15 us
# of GIL time on a 2-core Xeon (bench/worker_path.py), so hand-overs take at most about a third of the GIL
# whatever the batch.
HANDOVER_S_PER_STREAM = 50e-6


def handover_due(held_s: float, streams: int, first_token: bool) -> bool:
    """Whether the step thread hands its held outputs over now: at once for a request's first token (time
    to first token is not traded), else once they have been held (`held_s`: since the last hand-over)
    HANDOVER_S_PER_STREAM per stream in the step (a step with no outputs: at once)."""
    return first_token or held_s >= HANDOVER_S_PER_STREAM * streams


class EngineBackend(Backend):
    name = "cupy"

    def __init__(self, config, profile, model, block_sink: BlockSink | None = None, worker_id: str = "w0"):
        self._config, self._profile, self._info = config, profile, model
        self._engine_cfg = config.workers.engine
        self._block_sink, self.worker_id = block_sink, worker_id
        self._engine: Engine | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Inbox] = {}
        self._outbox: list[StepOutput] = []  # step outputs the step thread has not handed over yet
        self._fresh: set[str] = set()  # requests added with no output handed over yet (step thread's)
        self._handed_at = 0.0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._healthy = False
        self.device = "cpu"

    # --- sizes, from the engine config first and the device profile second -------------------------
    @property
    def context_length(self) -> int:
        limits = [self._info.context_length, self._profile.context_length, self._config.model.context_length]
        return min(x for x in limits if x)

    @property
    def block_size(self) -> int:
        return self._engine_cfg.block_size

    def _sizes(self) -> dict:
        cfg = self._engine_cfg
        return {
            "block_size": cfg.block_size,
            "num_blocks": cfg.kv_blocks or math.ceil(self._profile.kv_cache_tokens / cfg.block_size),
            "max_num_seqs": cfg.max_num_seqs or self._profile.max_num_seqs,
            "max_step_tokens": cfg.max_prefill_tokens,
            "context_length": self.context_length,
            "window_pool": cfg.window_pool,
        }

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._engine is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._engine, self._tokenizer = await asyncio.to_thread(self._build)
        self._texts = TokenTexts(self._tokenizer)
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.worker_id}", daemon=True)
        self._thread.start()
        self._healthy = True

    def _build(self):
        xp = array_module(self._engine_cfg.device)
        self.device = device_name(xp)
        weights = load_weights(self._info.path, self._engine_cfg.cache_dir)
        sizes = self._sizes()
        log.info("engine on %s: %s", self.device, sizes)
        if self._engine_cfg.pipeline_stages > 1 or self._engine_cfg.stages:  # layers in stage actors
            from workers.pipeline.build import build_for_backend

            if xp is np:
                _limit_blas_threads(self._engine_cfg.cpu_threads)
            engine = build_for_backend(self._info, weights, self._engine_cfg, xp, sizes, self._block_sink,
                                       self._config.server.ray_address is not None)
        elif xp is np:
            _limit_blas_threads(self._engine_cfg.cpu_threads)
            engine = create_engine(self._info, weights, xp, block_sink=self._block_sink, **sizes)
        else:  # the GPU engine: fused kernels, cuBLAS in graphs, decode as CUDA graphs (workers/cupy/gpu)
            from workers.cupy.gpu import create_gpu_engine

            engine = create_gpu_engine(self._info, weights, block_sink=self._block_sink, **sizes)
        tokenizer = load_tokenizer(self._info.path)
        engine.constraints = _constraints(tokenizer, self._info, xp)
        if self._engine_cfg.speculation:
            from workers.cupy.speculative import Speculator

            engine.speculator = Speculator(self._profile, gate=self._profile.speculation_gate)
        return engine, tokenizer

    async def close(self) -> None:
        thread, self._thread = self._thread, None
        self._healthy = False
        if thread is not None:
            self._inbox.put((_STOP, None))
            await asyncio.to_thread(thread.join)
        if getattr(self._engine, "pipeline_actors", None):
            from workers.pipeline.build import close_pipeline

            await asyncio.to_thread(close_pipeline, self._engine)
        for inbox in list(self._streams.values()):
            inbox.put(BackendError("the engine was closed", 503))
        self._engine = None

    async def health(self) -> bool:
        return self._healthy and self._thread is not None and self._thread.is_alive()

    async def cancel(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> BackendStats:
        eng = self._engine
        if eng is None:
            return BackendStats(healthy=False, block_size=self.block_size)
        gen, prefill = eng.rates()
        spec = eng.speculator
        pipe = self.pipeline_stats()
        return BackendStats(
            **({} if pipe is None else {
                "pipeline_transport": pipe["transport"], "pipeline_transfer_seconds": pipe["transfer_s"],
                "pipeline_transfer_bytes": pipe["bytes"], "pipeline_tokens": pipe["tokens"],
                "pipeline_rebuilds": pipe["rebuilds"]}),
            **({} if spec is None else {
                "speculation_k": spec.last_k, "steps_by_k": list(spec.steps_by_k),
                "drafted_by_position": list(spec.drafted_by_position),
                "accepted_by_position": list(spec.accepted_by_position),
                "speculation_gate": ({} if spec.gate is None
                                     else {str(c): v for c, v in spec.gate.snapshot().items()})}),
            running=len(eng.scheduler.running), waiting=len(eng.scheduler.waiting),
            slots=eng.scheduler.max_num_seqs, kv_blocks_total=eng.blocks.num_blocks,
            kv_blocks_used=eng.blocks.pressure_used, block_size=eng.blocks.block_size, tokens_per_s=gen,
            prefill_tokens_per_s=prefill, preemptions=eng.scheduler.preemptions, healthy=self._healthy,
        )

    def pipeline_stats(self) -> dict | None:
        """The pipeline's transport, bytes and transfer time per token (workers/pipeline); None without one."""
        stats = getattr(getattr(self._engine, "model", None), "stats", None)
        return stats.as_dict() if hasattr(stats, "as_dict") else None

    # --- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self._engine
        while True:
            idle = not eng.has_work()
            if idle:
                self._hand_over()
            if not self._drain_inbox(block=idle):
                self._hand_over()
                return
            if not eng.has_work():
                continue
            try:
                outputs = eng.step()
            except Exception as exc:  # a failed step fails its requests, not the worker process
                log.exception("engine step failed")
                recovery = getattr(eng, "pipeline_recovery", None)  # a pipeline stage died: rebuild it
                if recovery is not None and recovery.handles(exc):
                    self._recover(eng, recovery, exc)
                else:
                    self._fail_all(eng, f"engine step failed: {exc}")
                continue
            if outputs or self._outbox:  # a step with no outputs (a prefill-only step) hands over what is held
                self._keep(outputs)

    def _keep(self, outputs: list[StepOutput]) -> None:
        """Add a step's outputs to the outbox; hand it over when handover_due says so."""
        self._outbox += outputs
        first = False
        if self._fresh:
            for out in outputs:
                if out.request_id in self._fresh:
                    self._fresh.discard(out.request_id)
                    first = True
        if handover_due(time.monotonic() - self._handed_at, len(outputs), first):
            self._hand_over()

    def _hand_over(self) -> None:
        if self._outbox:
            outputs, self._outbox = self._outbox, []
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        self._handed_at = time.monotonic()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; False when asked to stop."""
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = item
            if kind is _STOP:
                return False
            if kind == "add":
                try:
                    self._engine.add(arg)
                    self._fresh.add(arg.request_id)
                except ValueError as exc:
                    self._post(arg.request_id, BackendError(str(exc), 400, "invalid_request_error"))
            elif kind == "abort":
                self._fresh.discard(arg)
                out = self._engine.abort(arg)
                if out is not None:
                    self._post(arg, out)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _recover(self, eng: Engine, recovery, exc: Exception) -> None:
        """workers/pipeline/recovery.py: unhealthy (new requests go elsewhere) until the stage is back."""
        self._healthy = False
        try:
            failed = recovery.run(exc)
        except Exception as again:
            log.exception("the pipeline could not be rebuilt")
            self._fail_all(eng, f"a pipeline stage was lost and could not be rebuilt: {again}")
            return  # stays unhealthy: the worker needs replacing
        for rid, err in failed.items():
            self._post(rid, err)
        self._healthy = True

    def _fail_all(self, eng: Engine, message: str) -> None:
        for rid in list(eng.seqs):
            eng.abort(rid, "error")
            self._post(rid, RuntimeError(message))

    def _post(self, request_id: str, item) -> None:
        """One item (an abort's output, an error) for one request, from the engine thread, after the outputs
        held back (in order: a request's tokens before its end)."""
        self._fresh.discard(request_id)
        self._hand_over()
        self._loop.call_soon_threadsafe(self._deliver_one, request_id, item)

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
        if self._engine is None or not self._healthy:
            raise BackendError("the engine is not running", 503)
        if request.max_tokens < 1:
            raise BackendError("max_tokens must be at least 1", 400, "invalid_request_error")
        if request.request_id in self._streams:
            raise BackendError(f"request id {request.request_id!r} is already running", 400,
                               "invalid_request_error")
        if request.grammar is not None:  # compile off the engine thread (cached per schema) so steps never wait
            await _prepare_grammar(self._engine, request.grammar)
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

    def __init__(self, request: GenerateRequest, outputs: _Inbox, tokenizer, texts: TokenTexts,
                 inbox: queue.SimpleQueue):
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


async def _prepare_grammar(engine: Engine, schema_text: str) -> None:
    from workers.cupy.constrain import GrammarError

    try:
        await asyncio.to_thread(engine.constraints.compiler.prepare, schema_text)
    except GrammarError as exc:
        raise BackendError(f"the grammar cannot be compiled: {exc}", 400, "invalid_request_error") from None
    except RuntimeError as exc:
        raise BackendError(str(exc), 503) from None


def _limit_blas_threads(threads: int | None) -> None:
    """Cap the BLAS pool for this process: on a 2-core box shared with the gateway and Ray, OpenBLAS'
    spinning threads made a decode step several times slower than one thread did."""
    if threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=threads, user_api="blas")
