"""The engine's step thread: requests and aborts in through a queue, step outputs out through `emit`.

EngineBackend runs one in the worker process (outputs handed to its event loop) or, with
`workers.engine.process`, in an engine process of its own (workers/cupy/engine_process.py: outputs sent over a
socket to the worker process, whose event loop then serves the streams). The loop itself is the same either way.

Under load the step thread holds outputs back for a few steps and hands them over together (see
HANDOVER_S_PER_STREAM): every hand-over wakes each running request's task and costs one write on its stream, all
under the GIL that the step thread needs between device steps (in one process), so at 64 streams handing over
every step left the engine waiting for the event loop. A request's first token is handed over at once, alone.
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable

from workers.protocol import BackendError

log = logging.getLogger(__name__)

STOP = object()
# How long the step thread may hold step outputs before handing them to the event loop, per stream that has
# output in the step (the default of `workers.engine.handover_us_per_stream`): up to 32 streams hand over every
# step of 1.6 ms or more, 64 streams every second 1.9 ms step (3.2 ms), 256 every seventh (12.8 ms). A stream's
# wake-up, chunk and write cost the event loop ~15 us of GIL time on a 2-core Xeon (bench/worker_path.py), so
# hand-overs take at most about a third of the GIL whatever the batch. Holding longer puts more tokens in each
# wake-up (200 us: the CPU box's worker path at 512 clients, worker CPU per token 21-23 -> 16 us, delivered +5-7%),
# but it holds a finished request's last tokens as long, and its place waits for the gateway to hear of the end:
# served on the H200 at temperature 1, 200 us gave 0.81x of 50 us at 64 clients and 0.91x at 256, 1.01-1.02x at
# 512-1,000, and 429s at 1,000 (BENCHMARKS.md, issue 25, 2026-12-03).
HANDOVER_S_PER_STREAM = 50e-6


class GcClock:
    """Seconds the cyclic garbage collector has run in this process (gc.callbacks), for the engine's stats: a
    collection stops every thread, the engine's step thread included, and py-spy counts its time in whatever frame
    allocated. Asked by issue 25's profile (`append_tokens` at ~2.4 us a sequence a step on the H200 against ~0.4 us
    in bench/step_host.py's emit part). bench/step_host.py's bare step (no hand-overs) spent 0.3-0.4% of its time
    collecting; with EngineLoop's held hand-overs (bench/engine_gc.py) Python's defaults took 21% at 256 sequences on
    the 2-core box, and served on the H200 6-13% (quiet_gc, below). One per process, installed by the first
    EngineLoop."""

    _installed: GcClock | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.seconds = 0.0
        self._started = 0.0

    @classmethod
    def installed(cls) -> GcClock:
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls()
                gc.callbacks.append(cls._installed._callback)
            return cls._installed

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


# Young collections in an engine process with quiet_gc: one once this many more container objects were made than freed
# (Python's default is 700: at 256 sequences one about every step, which promotes the step outputs held for a hand-over
# and so brings on whole-heap collections, ~5 a second in bench/engine_gc.py).
GC_YOUNG_THRESHOLD = 20_000


def quiet_gc(young: int = GC_YOUNG_THRESHOLD) -> None:
    """Garbage collection for a process that steps an engine (`workers.engine.quiet_gc`, off by default): what exists
    once the engine is built (the KV pools' block objects, the model, imported modules) is collected once and then
    frozen out of every later collection (gc.freeze), and a young collection waits until `young` more container
    objects have been made than freed (Python's default: 700). Served on the H200 without it, the engine process
    spent 6-13% of its wall time collecting, more as the batch grew (256 against 192) and as the server aged
    (bench/served.py's gc_share; BENCHMARKS.md, issue 25): each whole-heap collection walked every block of the KV
    pools while the step thread waited (bench/engine_gc.py, the 2-core box: 21% -> 0, 1.29x the host's steps a
    second). Objects made after the freeze are collected as before; frozen ones that become garbage are only freed
    with their process (they live as long as the engine does). Off by default: served on the H200 (2026-12-04,
    256 and 1,000 clients, the run order balanced) it was 0.93-1.01x Python's defaults, though its collection time
    was 0 against their 6-11%: the step there waits on the device, and the collector's time overlaps it."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)


def handover_due(held_s: float, streams: int, per_stream_s: float = HANDOVER_S_PER_STREAM) -> bool:
    """Whether the step thread hands its held outputs over now: once they have been held (`held_s`: since the
    last hand-over) `per_stream_s` per stream in the step (a step with no outputs: at once). A request's
    first token does not wait for this: it goes at once, on its own (EngineLoop._keep)."""
    return held_s >= per_stream_s * streams


class EngineLoop:
    """Steps `engine` while it has work. `emit(outputs)` takes a hand-over of step outputs; `emit_one(request_id,
    item)` one item (an abort's output, an error) for one request, always after the outputs held before it.
    Both are called from the step thread. `inbox` takes ("add", GenerateRequest), ("abort", request_id) and
    (STOP, None)."""

    def __init__(self, engine, emit: Callable[[list], None], emit_one: Callable[[str, object], None],
                 on_health: Callable[[bool], None] = lambda healthy: None,
                 hold_s_per_stream: float = HANDOVER_S_PER_STREAM):
        self.engine, self.emit, self.emit_one, self.on_health = engine, emit, emit_one, on_health
        self.hold_s_per_stream = hold_s_per_stream
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: list = []  # step outputs not handed over yet
        self._fresh: set[str] = set()  # requests added with no output handed over yet
        self._handed_at = 0.0
        GcClock.installed()

    def run(self) -> None:
        eng = self.engine
        while True:
            idle = not eng.has_work()
            if idle:
                self._hand_over()
            t0 = time.perf_counter()
            if not self._drain_inbox(block=idle):
                self._hand_over()
                return
            if not idle:  # a blocking wait for work is idle time, not the thread's work
                self._phase("inbox", t0)
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
                t0 = time.perf_counter()
                self._keep(outputs)
                self._phase("handover", t0)

    def _phase(self, name: str, t0: float) -> None:
        phases = getattr(self.engine, "phase_seconds", None)  # Engine.phase_seconds (an engine stand-in may lack it)
        if phases is not None:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    def _keep(self, outputs: list) -> None:
        """Add a step's outputs to the outbox; hand it over when handover_due says so. A request's first token
        goes at once (time to first token is not traded), on its own: the others' outputs stay held. Handing
        everything over with it made every step a hand-over of every stream once requests arrive about every
        step, as past saturation, where a finished request's place is taken at once: the event loop then woke
        each running stream each step."""
        first: list = []
        if self._fresh:
            for out in outputs:
                if out.request_id in self._fresh:
                    self._fresh.discard(out.request_id)
                    first.append(out)
        if handover_due(time.monotonic() - self._handed_at, len(outputs), self.hold_s_per_stream):
            self._outbox += outputs
            self._hand_over()
            return
        if first:
            # a fresh request has nothing held (this is its first output), so sending it ahead of what is held
            # keeps each request's outputs in order
            if len(first) < len(outputs):
                ids = {out.request_id for out in first}
                self._outbox += [out for out in outputs if out.request_id not in ids]
            self.emit(first)
        else:
            self._outbox += outputs

    def _hand_over(self) -> None:
        if self._outbox:
            outputs, self._outbox = self._outbox, []
            self.emit(outputs)
        self._handed_at = time.monotonic()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; False when asked to stop."""
        try:
            item = self.inbox.get() if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = item
            if kind is STOP:
                return False
            if kind == "add":
                try:
                    self.engine.add(arg)
                    self._fresh.add(arg.request_id)
                except ValueError as exc:
                    self._post(arg.request_id, BackendError(str(exc), 400, "invalid_request_error"))
            elif kind == "abort":
                self._fresh.discard(arg)
                out = self.engine.abort(arg)
                if out is not None:
                    self._post(arg, out)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _recover(self, eng, recovery, exc: Exception) -> None:
        """workers/pipeline/recovery.py: unhealthy (new requests go elsewhere) until the stage is back."""
        self.on_health(False)
        try:
            failed = recovery.run(exc)
        except Exception as again:
            log.exception("the pipeline could not be rebuilt")
            self._fail_all(eng, f"a pipeline stage was lost and could not be rebuilt: {again}")
            return  # stays unhealthy: the worker needs replacing
        for rid, err in failed.items():
            self._post(rid, err)
        self.on_health(True)

    def _fail_all(self, eng, message: str) -> None:
        for rid in list(eng.seqs):
            eng.abort(rid, "error")
            self._post(rid, RuntimeError(message))

    def _post(self, request_id: str, item) -> None:
        """One item for one request after the outputs held back (in order: a request's tokens before its end)."""
        self._fresh.discard(request_id)
        self._hand_over()
        self.emit_one(request_id, item)


def pipeline_stats(eng) -> dict | None:
    """A pipelined engine's transport, bytes and transfer time per token (workers/pipeline); None otherwise."""
    stats = getattr(getattr(eng, "model", None), "stats", None)
    return stats.as_dict() if hasattr(stats, "as_dict") else None


def engine_snapshot(eng) -> dict:
    """The engine's side of BackendStats (fields by name), read from any thread."""
    custom = getattr(eng, "stats_snapshot", None)
    if custom is not None:  # an engine stand-in (bench/worker_path.py) says what it has
        return custom()
    gen, prefill = eng.rates()
    spec = eng.speculator
    pipe = pipeline_stats(eng)
    return {
        **({} if pipe is None else {
            "pipeline_transport": pipe["transport"], "pipeline_transfer_seconds": pipe["transfer_s"],
            "pipeline_transfer_bytes": pipe["bytes"], "pipeline_tokens": pipe["tokens"],
            "pipeline_rebuilds": pipe["rebuilds"]}),
        **({} if spec is None else {
            "speculation_k": spec.last_k, "steps_by_k": list(spec.steps_by_k),
            "drafted_by_position": list(spec.drafted_by_position),
            "accepted_by_position": list(spec.accepted_by_position),
            "speculation_gate": ({} if spec.gate is None
                                 else {str(c): v for c, v in spec.gate.snapshot().items()}),
            "speculation_prior": spec.prior.snapshot()}),
        "running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting),
        "slots": eng.scheduler.max_num_seqs, "kv_blocks_total": eng.blocks.num_blocks,
        "kv_blocks_used": eng.blocks.pressure_used, "block_size": eng.blocks.block_size, "tokens_per_s": gen,
        "prefill_tokens_per_s": prefill, "preemptions": eng.scheduler.preemptions,
        "forwards_by_path": dict(getattr(eng.model, "step_kinds", None) or {}),
        "steps_ahead": getattr(eng, "steps_ahead", 0),
        "step_seconds": getattr(eng, "step_seconds", 0.0),
        "token_wait_seconds": getattr(eng, "token_wait_seconds", 0.0),
        "step_phase_seconds": dict(getattr(eng, "phase_seconds", None) or {}),
        # the GPU attention kernel's compile-time settings (workers/cupy/gpu/kernels.py), {} without one
        "attention_settings": dict(getattr(getattr(getattr(eng, "model", None), "kernels", None), "att_settings",
                                           None) or {}),
        "gc_seconds": GcClock.installed().seconds,
        "gc_frozen": gc.get_freeze_count(),
    }
