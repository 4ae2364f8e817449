"""The managed llama-server as a Pulse Backend (contract: workers/protocol/__init__.py).

Each request goes to llama-server's native /completion endpoint as the gateway's token ids, with
`cache_prompt` and a slot chosen for prefix affinity, streamed back event by event. Faults:
- the process dies: its sockets close, so every in-flight stream ends at once (an error chunk, or
  BackendError 503 before the first chunk); the supervisor restarts it with backoff;
- the process hangs: no event on a stream for `stream_idle_timeout_s` is the same error. Waiting for
  the response headers and the first event (llama-server's queue and the prefill: this build sends the
  headers at once, older ones with the first token) is not: every `headers_timeout_s` the process must show
  it is alive, by tokens flowing on any stream within `health_timeout_s` or by answering /health within
  `health_timeout_s` on a connection of its own; only one that does neither is killed and restarted.
  A busy llama-server is not an unhealthy one.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec

from workers.llama_server import api, http
from workers.llama_server.binary import find_llama_server
from workers.llama_server.checkpointer import Checkpointer
from workers.llama_server.checkpoints import CheckpointStore
from workers.llama_server.lane import Lane, build_lanes, choose_lane
from workers.protocol import Backend, BackendError, BackendStats, Chunk, GenerateRequest, Usage
from workers.protocol import telemetry as tm
from workers.protocol.model import cache_root

log = logging.getLogger("pulse.llama_server")
CONNECT_TIMEOUT_S = 5.0
# OSError: a connection to llama-server that cannot be made (workers/llama_server/http.py; ConnectionError and
# TimeoutError are OSErrors too)
_CONNECTION_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class _Flight:
    __slots__ = ("lane", "resp", "cancelled")

    def __init__(self, lane: Lane):
        self.lane, self.resp, self.cancelled = lane, None, False


class LlamaServerBackend(Backend):
    name = "llama-server"

    def __init__(self, config, profile, model, block_sink=None, worker_id: str = "w0"):
        self.cfg = config.workers.llama_server
        self.profile, self.model, self.worker_id = profile, model, worker_id
        self.block_size = config.workers.engine.block_size  # the prefix-hash block the router uses
        self.block_sink = block_sink
        self.workers_on_box = config.workers.box_workers or config.workers.count or 1
        self.lanes: list[Lane] = []
        self._flights: dict[str, _Flight] = {}
        self._session: aiohttp.ClientSession | None = None
        self._probes: set[asyncio.Task] = set()
        self._done: deque[tuple[float, int, int]] = deque(maxlen=4096)  # (time, generated, prefilled)
        self._closed = False
        self.checkpoints = self._checkpointer(self.cfg.checkpoints)
        self.tracer = tm.trace.get_tracer("pulse.worker")  # the process's provider (setup_tracing) once it is set

    def _checkpointer(self, ck) -> Checkpointer | None:
        if not ck.enabled:
            return None
        base = Path(ck.dir).expanduser() if ck.dir else cache_root() / "checkpoints"
        store = CheckpointStore(base / self.worker_id, max_files=ck.max_files, max_bytes=int(ck.max_gib * 2**30),
                                sink=self.block_sink)
        return Checkpointer(ck, store, self.block_size, timeout_s=self.cfg.headers_timeout_s,
                            root=self.model.chain_root.hash)

    async def start(self) -> None:
        binary = find_llama_server(self.cfg.binary)
        log_dir = Path(self.cfg.log_dir).expanduser() if self.cfg.log_dir else cache_root() / "logs"
        checkpoint_dir = None
        if self.checkpoints is not None:
            self.checkpoints.store.clear_dir()
            checkpoint_dir = self.checkpoints.store.dir
        self.lanes = build_lanes(self.cfg, self.profile, self.model.path, binary, self.block_size,
                                 log_dir, self.worker_id, self.block_sink, self.workers_on_box, checkpoint_dir,
                                 root=self.model.chain_root.hash)
        for lane in self.lanes:
            lane.on_crash = self._on_crash
        # Generations go over workers/llama_server/http.py, one connection per request, no keep-alive:
        # llama-server (cpp-httplib) closes idle connections after 5 s and after 100 requests, and a POST on
        # a connection it just closed fails with no way to retry safely; an idle kept-alive connection also
        # holds one of its HTTP threads. This session serves /health and the checkpointer's slot actions.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True), auto_decompress=False)
        if self.checkpoints is not None:
            self.checkpoints.session = self._session
        try:
            await asyncio.gather(*(lane.process.start() for lane in self.lanes))
        except BaseException:
            await self.close()
            raise
        log.info("llama-server %s ready: %s", self.worker_id,
                 ", ".join(f"{lane.name} pid {lane.process.pid} at {lane.process.url}" for lane in self.lanes))

    # -- generation ---------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        return self._resume(request) if request.resume_ids else self._generate(request)

    async def _resume(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """A migrated generation: llama-server continues from prompt + resumed tokens, and usage counts as
        one generation. llama-server cannot start a grammar mid-way, and its seeded sampler draws from a
        stateful generator, so a seeded sampled continuation differs from an undisturbed run (greedy is
        the same); stop strings see only text generated here."""
        if request.grammar is not None:
            raise BackendError("llama-server cannot resume a grammar-constrained generation", 400, "cannot_resume")
        done = len(request.resume_ids)
        inner = msgspec.structs.replace(request, prompt_ids=request.prompt_ids + request.resume_ids,
                                        max_tokens=request.max_tokens - done, resume_ids=[])
        async with contextlib.aclosing(self._generate(inner)) as chunks:  # closing it early cancels llama-server's task
            async for chunk in chunks:
                if chunk.usage is not None:
                    chunk.usage.prompt_tokens = len(request.prompt_ids)
                    chunk.usage.completion_tokens += done
                    chunk.usage.cached_tokens = min(chunk.usage.cached_tokens, len(request.prompt_ids))
                yield chunk

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        if self._closed or not self.lanes:
            raise BackendError("llama-server backend is not running", 503)
        if request.request_id in self._flights:
            raise BackendError(f"request id {request.request_id!r} is already running", 409, "conflict")
        lane = choose_lane(self.lanes, self.profile, len(request.prompt_ids), request.max_draft_tokens,
                           schema=request.grammar is not None)
        await self._wait_ready(lane)
        prompt = request.prompt_ids
        if self.checkpoints is not None and lane.checkpoints:  # may restore into the slot, or save it first
            slot, hashes = await self.checkpoints.prepare(lane, prompt)
        else:
            slot, hashes = (lane.slots.choose(prompt) if self.cfg.slot_affinity else None), None
        # slots.py: a request sent to a named slot counts as such until its first event; one with no slot makes
        # Pulse name none for others until its first event says which llama-server chose
        named = slot is not None
        # every slot has a request already: this one will wait in llama-server's own queue (slots.py)
        beyond = lane.running >= len(lane.slots.slots)
        if named:
            ticket = lane.slots.acquire(slot, prompt, hashes)
            lane.slots.sent_named()
        else:
            ticket = -1
            lane.slots.sent_unplaced(beyond)
        flight = self._flights[request.request_id] = _Flight(lane)
        span = self._client_span(lane, slot, beyond)
        lane.running += 1
        generated: list[int] = []
        stop_ids = set(request.stop_token_ids)
        started = failed = False
        try:
            if not named:  # after the requests sent before it that it could overtake on the way (slots.py)
                await lane.slots.named_ahead(self.cfg.hold_ms / 1000, beyond=beyond)
            resp = await self._open(lane, request, slot, flight, span)
            first = True
            while True:
                ev = await (self._first_event(lane, resp) if first else self._next_event(resp))
                first = False
                lane.progress_at = time.monotonic()
                if named:
                    named = False
                    lane.slots.started()
                if slot is None and ev.id_slot >= 0:  # llama-server chose the slot: now we know which
                    slot = ev.id_slot
                    ticket = lane.slots.acquire(slot, prompt)
                    lane.slots.placed(beyond)
                if ev.error is not None:
                    raise ConnectionError(f"llama-server error: {ev.error.get('message', ev.error)}")
                if stop_ids and (cut := _stop_cut(ev.tokens, stop_ids)) is not None:
                    generated += ev.tokens[: cut + 1]
                    text = ev.content if cut > 0 else ""  # an event is one token unless speculating
                    usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(generated))
                    yield Chunk(text=text, token_ids=ev.tokens[:cut], finish_reason="stop", usage=usage)
                    return
                generated += ev.tokens
                logprobs = api.logprobs_of(ev, request.logprobs or 0)
                if span is not None and not started and (ev.content or ev.tokens or ev.stop):
                    span.add_event(tm.EVENT_LLAMA_FIRST_TOKEN)  # (a stop with none before: the first and the last)
                if ev.stop:
                    self._record(ev)
                    if span is not None:
                        _timings_on(span, ev.timings)
                    yield Chunk(text=ev.content, token_ids=ev.tokens, logprobs=logprobs,
                                finish_reason=api.FINISH.get(ev.stop_type, "stop"),
                                usage=api.usage_of(ev, len(prompt)))
                    return
                if ev.content or ev.tokens:
                    started = True
                    yield Chunk(text=ev.content, token_ids=ev.tokens, logprobs=logprobs)
        except BackendError as e:
            failed = True
            if span is not None:
                span.set_status(tm.trace.StatusCode.ERROR, e.message)
            raise
        except _CONNECTION_ERRORS as e:
            usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(generated))
            if flight.cancelled:
                yield Chunk(finish_reason="cancelled", usage=usage)
                return
            message = self._failure(lane, e)
            failed = True
            if span is not None:
                span.set_status(tm.trace.StatusCode.ERROR, message)
            if not started:
                raise BackendError(message, 503) from None
            yield Chunk(finish_reason="error", error=message, usage=usage)
        finally:
            if flight.resp is not None:
                flight.resp.close()  # closing the connection makes llama-server cancel the task
            if span is not None:
                if slot is not None:
                    span.set_attribute(tm.PULSE_LLAMA_SLOT, slot)
                span.end()
            lane.running -= 1
            self._flights.pop(request.request_id, None)
            if named:  # ended before it started
                lane.slots.started()
            if ticket < 0:  # ended before llama-server named its slot
                lane.slots.placed(beyond)
            if slot is not None:
                lane.slots.release(slot, ticket, generated, failed)
                if self.checkpoints is not None and lane.checkpoints and not failed:
                    self.checkpoints.after_request(lane, slot)

    def _client_span(self, lane: Lane, slot: int | None, beyond: bool):
        """The `pulse.llama_server` CLIENT span (docs/METRICS.md): from the request's arrival here to its last
        event, under the worker's span of the request, with when it was sent (after any hold, slots.py), when
        llama-server's headers came and when its first token did (after its own queue and the prefill), the slot
        named and the one llama-server ran it in, whether it went beyond the slots, and llama-server's own timings:
        what tells a wait in Pulse from one in llama-server. None when the request's span is not recorded (nothing
        exports): one check a request then."""
        if not tm.trace.get_current_span().is_recording():
            return None
        span = self.tracer.start_span(tm.SPAN_LLAMA_SERVER, kind=tm.trace.SpanKind.CLIENT)
        span.set_attributes({tm.PULSE_WORKER: self.worker_id, tm.PULSE_LLAMA_LANE: lane.name,
                             tm.PULSE_LLAMA_SLOT_NAMED: -1 if slot is None else slot,
                             tm.PULSE_LLAMA_BEYOND_SLOTS: beyond, tm.PULSE_LLAMA_RUNNING: lane.running})
        return span

    async def _wait_ready(self, lane: Lane) -> None:
        if lane.ready:
            return
        try:
            await asyncio.wait_for(lane.process.ready.wait(), self.cfg.headers_timeout_s)
        except asyncio.TimeoutError:
            raise BackendError("llama-server is restarting", 503) from None

    async def _open(self, lane: Lane, request: GenerateRequest, slot: int | None, flight: _Flight,
                    span=None) -> http.LlamaStream:
        """POST the request and wait for the response headers. This llama-server build sends them at once;
        older ones sent them with the first token, after queueing and prefill (minutes for a long cold prompt on
        a small box; `_first_event` waits for that now), so a slow answer alone is not a fault: every
        `headers_timeout_s` without headers the process must show it is alive (`_alive`), and only one that does
        not counts as hung (killed, then restarted). The stream is the flight's from the moment it connects:
        cancel() or a crash closes it, which ends the wait at once (and makes llama-server drop the task).
        `span`: the request's `pulse.llama_server` span (or None), whose context goes in its `traceparent`
        header."""
        body = api.request_body(request, slot, exact_seed=self.profile.kind != "cpu")
        headers = None
        if span is not None:
            span.add_event(tm.EVENT_LLAMA_SENT)
            headers = tm.inject_context(tm.trace.set_span_in_context(span))
        resp = flight.resp = await http.open_stream("127.0.0.1", lane.process.port, "/completion", body,
                                                    connect_timeout_s=CONNECT_TIMEOUT_S, headers=headers)
        if flight.cancelled:  # cancel() came while connecting
            raise ConnectionError("cancelled")
        while not await resp.head(self.cfg.headers_timeout_s):
            if not await self._alive(lane):
                raise asyncio.TimeoutError(
                    f"no response headers within {self.cfg.headers_timeout_s:.1f} s, no tokens on any stream "
                    f"and no answer to /health within {self.cfg.health_timeout_s:.1f} s")
        if span is not None:
            span.add_event(tm.EVENT_LLAMA_HEADERS)
        if resp.status != 200:
            raise api.error_of(resp.status, await resp.body(self.cfg.headers_timeout_s))
        return resp

    async def _first_event(self, lane: Lane, resp: http.LlamaStream) -> api.Event:
        """The stream's first event: after llama-server's own queue and the prefill, which take as long as they
        take (a long prompt on a small box: minutes; this build sends its headers at once, so `_open` returns before
        them). As for the headers, a wait is a fault only where the process shows no life (`_alive`); it was the
        `stream_idle_timeout_s` between two events, so a prefill or a queue in llama-server longer than that (60 s)
        failed a request no fault had touched."""
        while True:
            try:
                return await self._next_event(resp, self.cfg.headers_timeout_s)
            except asyncio.TimeoutError:
                if not await self._alive(lane):
                    raise asyncio.TimeoutError(
                        f"no event within {self.cfg.headers_timeout_s:.1f} s, no tokens on any stream and no "
                        f"answer to /health within {self.cfg.health_timeout_s:.1f} s") from None

    async def _next_event(self, resp: http.LlamaStream, timeout_s: float | None = None) -> api.Event:
        line = await resp.line(self.cfg.stream_idle_timeout_s if timeout_s is None else timeout_s)
        if line.startswith(b"data: "):
            return api.decode_event(line[6:])
        if not line:
            raise ConnectionError("llama-server closed the stream before its final event")
        raise ConnectionError(f"llama-server error: {line[7:].decode(errors='replace').strip()}")

    def _failure(self, lane: Lane, e: BaseException) -> str:
        """Describe a failed stream; if it looks like a hang, check /health and kill a hung process."""
        if isinstance(e, asyncio.TimeoutError):
            task = asyncio.create_task(self._probe(lane))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
            return f"llama-server timed out ({e or 'no event within stream_idle_timeout_s'})"
        if not lane.ready:
            return "llama-server process died"
        return f"llama-server connection failed: {type(e).__name__}: {e}"

    async def _probe(self, lane: Lane) -> None:
        await self._alive(lane)

    async def _alive(self, lane: Lane) -> bool:
        """Whether the process is alive: tokens reached a stream within `health_timeout_s` (its main loop
        is working), else it answers /health within that time (llama-server's HTTP threads answer it while
        the main loop is busy; the session opens a new connection per request). One that does neither is
        killed (and restarts)."""
        proc = lane.process
        pid = proc.pid
        wait = self.cfg.health_timeout_s
        if time.monotonic() - lane.progress_at < wait:
            return True
        try:
            async with self._session.get(proc.url + "/health", timeout=aiohttp.ClientTimeout(total=wait)) as r:
                await r.read()
                return True
        except _CONNECTION_ERRORS:
            pass
        if pid is not None and proc.pid == pid:  # still the same (hung) process: kill it, it restarts
            log.error("%s pid %d does not answer /health: killing it", lane.name, pid)
            proc.kill_now()
        return False

    def _on_crash(self, lane: Lane, returncode: int) -> None:
        for flight in self._flights.values():
            if flight.lane is lane and flight.resp is not None:
                flight.resp.close()  # its socket is closed already; this makes sure the reader wakes now

    def _record(self, ev: api.Event) -> None:
        if ev.timings is not None:
            self._done.append((time.monotonic(), ev.timings.predicted_n, ev.timings.prompt_n))

    # -- the rest of the contract --------------------------------------------------------------------

    async def cancel(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.cancelled = True
            if flight.resp is not None:
                flight.resp.close()

    async def health(self) -> bool:
        return not self._closed and any(lane.ready for lane in self.lanes)

    def stats(self) -> BackendStats:
        now = time.monotonic()
        window = [(t, g, p) for t, g, p in self._done if now - t <= 10.0]
        slots = sum(len(lane.slots.slots) for lane in self.lanes) or 1
        running = sum(lane.running for lane in self.lanes)
        kv_tokens = self.cfg.kv_tokens or self.profile.kv_cache_tokens
        # queue_max: as many beyond the slots as there are slots, in llama-server's own queue, which costs nothing a
        # step and keeps arrival order (the gateway replicas' queues do not across replicas: the README, "Slot choice")
        return BackendStats(
            running=min(running, slots), waiting=max(0, running - slots), slots=slots, queue_max=slots,
            kv_blocks_total=len(self.lanes) * kv_tokens // self.block_size,
            kv_blocks_used=sum(lane.slots.used_blocks() for lane in self.lanes),
            block_size=self.block_size,
            tokens_per_s=sum(g for _, g, _ in window) / 10.0,
            prefill_tokens_per_s=sum(p for _, _, p in window) / 10.0,
            restarts=sum(lane.process.restarts for lane in self.lanes),
            healthy=not self._closed and any(lane.ready for lane in self.lanes))

    def cached_blocks(self) -> dict[str, list[int]]:
        """Every block this worker holds, by tier: the source of truth for the prefix index's snapshots."""
        gpu = {h for lane in self.lanes for s in lane.slots.slots for h in s.hashes}
        blocks = {"gpu": list(gpu)}
        if self.checkpoints is not None:
            blocks["checkpoint"] = self.checkpoints.store.blocks()
        return blocks

    def pids(self) -> list[int]:
        return [lane.process.pid for lane in self.lanes if lane.process.pid is not None]

    async def close(self) -> None:
        self._closed = True
        for request_id in list(self._flights):
            await self.cancel(request_id)
        for task in list(self._probes):
            task.cancel()
        if self.checkpoints is not None:
            await self.checkpoints.close()
        await asyncio.gather(*(lane.process.stop() for lane in self.lanes), return_exceptions=True)
        if self.checkpoints is not None:
            self.checkpoints.store.remove_all()  # a later run could not find them again (checkpoints.py)
        if self._session is not None:
            await self._session.close()
            self._session = None


def _timings_on(span, timings: api.Timings | None) -> None:
    """llama-server's own account of the request, from its final event, on the request's span."""
    if timings is not None:
        span.set_attributes({tm.PULSE_LLAMA_PROMPT_MS: timings.prompt_ms, tm.PULSE_LLAMA_PREDICTED_MS:
                             timings.predicted_ms, tm.PULSE_LLAMA_PROMPT_N: timings.prompt_n,
                             tm.PULSE_LLAMA_CACHE_N: timings.cache_n, tm.PULSE_LLAMA_PREDICTED_N: timings.predicted_n})


def _stop_cut(tokens: list[int], stop_ids: set[int]) -> int | None:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i
    return None
