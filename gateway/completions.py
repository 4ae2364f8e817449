"""The chat core every generation endpoint runs: request -> prompt ids -> a worker -> tokens back.

Hot path. The first token is flushed at once; a worker that fails before the first byte is retried
elsewhere; one that fails after it hands the generation to another worker, which continues it
(gateway/migration.py); only when none can does the client get one in-band SSE error event.

Each API (chat and text completions here; the Responses and Messages adapters elsewhere) is a `prepare`
function that turns its body into a `Call` (a GenerateRequest plus that protocol's `Events` writer);
`CompletionService.serve` then does the same auth, quota, admission, routing and relay for all of them.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

import msgspec
from aiohttp import web

from gateway import structured
from gateway import tools as agent_tools
from gateway.auth import KeyAuth
from gateway.dispatch import Dispatcher
from gateway.errors import APIError, bad_param, error_body
from gateway.migration import Relay
from gateway.models import ModelCatalog, ServedModel
from gateway.openai_types import (
    ChatRequest,
    CompletionRequest,
    decode,
    stop_list,
    text_of,
    validate_chat,
    validate_completion,
)
from gateway.responses import Shaper
from policy.config import PulseConfig
from workers.protocol import Chunk, GenerateRequest, SamplingParams, TokenLogprob, Usage
from workers.protocol import telemetry as tm

log = logging.getLogger("pulse.gateway")
_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


@dataclass
class Call:
    """One accepted generation, whatever protocol it came in: what the chat core needs to run it."""

    model: str
    gen: GenerateRequest
    stream: bool
    events: "Events"
    operation: str = "chat"  # gen_ai.operation.name


class Events(ABC):
    """How one protocol writes a generation back; each API adapter subclasses it.

    `delta` gives the SSE bytes of output text (`first`: the stream's first write, which opens it);
    `end` the final events, after any async work that must finish before the client sees the end (a
    stored response); `error` one in-band error event after output has started; `whole` the body of a
    non-streamed answer."""

    @abstractmethod
    def delta(self, text: str, logprobs: list[TokenLogprob] | None, first: bool) -> bytes:
        ...

    @abstractmethod
    async def end(self, finish: str, usage: Usage) -> bytes:
        ...

    def error(self, message: str) -> bytes:
        return _error_event(message)

    @abstractmethod
    async def whole(self, text: str, finish: str, usage: Usage, logprobs: list[TokenLogprob] | None) -> dict:
        ...


class ChatEvents(Events):
    """Chat and text completions: OpenAI chunks as `data:` lines, then `data: [DONE]`."""

    def __init__(self, shaper, include_usage: bool):
        self.shaper, self.include_usage = shaper, include_usage
        self._frame: tuple[bytes, bytes] | None = None

    def delta(self, text, logprobs, first) -> bytes:
        if text and not logprobs and not first and type(self.shaper) is Shaper:
            # most events of a stream: only the text is new; the bytes around it are the same every time
            head, tail = self._frame or self._text_frame()
            return head + _json.encode(text) + tail
        return _event(self.shaper.stream_chunk(text, None, logprobs, first))

    def _text_frame(self) -> tuple[bytes, bytes]:
        """The event bytes before and after a plain text delta's JSON string, cut from one encoded by the
        shaper itself, so the result is byte for byte what encoding the whole chunk gives."""
        mark = "\x00text\x00"
        head, _, tail = _event(self.shaper.stream_chunk(mark, None, None, False)).partition(_json.encode(mark))
        self._frame = (head, tail)
        return self._frame

    async def end(self, finish, usage) -> bytes:
        out = [_event(self.shaper.stream_chunk("", finish, None, False))]
        if self.include_usage:
            out.append(_event(self.shaper.usage_chunk(usage)))
        out.append(DONE)
        return b"".join(out)

    async def whole(self, text, finish, usage, logprobs) -> dict:
        return self.shaper.whole(text, finish, usage, logprobs)


def credentials(headers) -> str | None:
    """The Authorization header, or an `x-api-key` (Anthropic's clients) as a bearer token."""
    auth = headers.get("Authorization")
    if auth or not headers.get("x-api-key"):
        return auth
    return "Bearer " + headers["x-api-key"]


class CompletionService:
    def __init__(self, config: PulseConfig, models: ModelCatalog, dispatcher: Dispatcher, auth: KeyAuth, *,
                 metrics, tracer):
        self.cfg, self.models, self.dispatcher, self.auth = config, models, dispatcher, auth
        self.metrics, self.tracer = metrics, tracer
        self.schemas = structured.SchemaChecker()  # compiles request schemas off the event loop
        self._limits = dict(max_stop_strings=config.server.max_stop_strings,
                            max_stop_length=config.server.max_stop_length)

    # ---- request -> GenerateRequest ------------------------------------------------------------
    def parse_chat(self, body: bytes) -> tuple[ChatRequest, GenerateRequest]:
        return self.chat_request(decode(body, ChatRequest))

    def chat_request(self, req: ChatRequest) -> tuple[ChatRequest, GenerateRequest]:
        """A decoded chat request -> its GenerateRequest: the one templating and tokenization of every API."""
        validate_chat(req, max_messages=self.cfg.server.max_messages, **self._limits)
        model = self.models.get(req.model)
        plan = agent_tools.plan_chat(req)  # tools, tool_choice, response_format (400s name the parameter)
        prompt = agent_tools.build_prompt(model.builder, req.messages, plan)
        top = (req.top_logprobs or 0) if req.logprobs else None
        gen = self._generate_request(model, req, prompt.ids, req.max_completion_tokens or req.max_tokens, top)
        gen.grammar = plan.grammar
        return req, gen

    def parse_completion(self, body: bytes) -> tuple[CompletionRequest, GenerateRequest]:
        req = decode(body, CompletionRequest)
        validate_completion(req, **self._limits)
        model = self.models.get(req.model)
        prompt = model.builder.completion(req.prompt)
        if any(not 0 <= t < (1 << 31) for t in prompt.ids):
            raise bad_param("prompt", "token ids must be non-negative 32-bit integers")
        return req, self._generate_request(model, req, prompt.ids, req.max_tokens, req.logprobs)

    def _generate_request(self, model: ServedModel, req, ids: list[int], max_tokens: int | None,
                          logprobs: int | None) -> GenerateRequest:
        n = len(ids)
        if n == 0:
            raise bad_param("prompt" if isinstance(req, CompletionRequest) else "messages", "the prompt is empty")
        ctx = model.context_length
        room = ctx - n
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt has "
                           f"{n} tokens, {n - ctx + 1} too many to generate even one token.",
                           param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt has "
                           f"{n} and max_tokens asks for {max_tokens}: {n + max_tokens - ctx} over.",
                           param="max_tokens", code="context_length_exceeded")
        prediction = None
        if req.prediction is not None:
            prediction = model.builder.encode_plain(text_of(req.prediction.content))
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            model=model.name,
            prompt_ids=ids,
            max_tokens=max_tokens or room,
            sampling=SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
            ),
            stop=stop_list(req.stop),
            ignore_eos=req.ignore_eos,
            max_draft_tokens=req.max_draft_tokens,
            prediction_ids=prediction,
            logprobs=logprobs,
            priority=req.priority,
        )

    # ---- responses -----------------------------------------------------------------------------
    async def respond(self, request: web.Request, kind: str, body: bytes) -> web.StreamResponse:
        """POST /v1/chat/completions (kind "chat") and /v1/completions ("completion")."""
        async def prepare(body: bytes, key) -> Call:
            req, gen = await parse_off_loop(self.parse_chat if kind == "chat" else self.parse_completion, body)
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + gen.request_id
            shaper = Shaper(kind, rid, int(time.time()), gen.model, self.models.get(gen.model).token_text)
            if kind == "chat":
                shaper = agent_tools.ToolShaper.wrap(req, shaper)  # tool calls out of the text
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return Call(req.model, gen, req.stream, ChatEvents(shaper, include_usage),
                        "chat" if kind == "chat" else "text_completion")

        return await self.serve(request, "chat" if kind == "chat" else "completions", prepare, body)

    async def _prepare(self, prepare, body: bytes, key) -> Call:
        """`prepare` with its schemas compiled off the event loop (gateway/structured.py). A failed check
        parses once more with the verdicts cached, so the adapter raises the 400 in its own words."""
        with structured.deferred() as schemas:
            call = await prepare(body, key)
        try:
            await self.schemas.check(schemas)
        except APIError as e:
            if e.code in ("invalid_schema", "schema_too_complex"):
                with structured.cached_only():
                    await prepare(body, key)
            raise
        return call

    async def serve(self, request: web.Request, api: str, prepare, body: bytes) -> web.StreamResponse:
        """Run one generation request of any API: `await prepare(body, key)` gives its Call; `api` labels
        its metrics. Auth, quota, admission, routing, the relay and the accounting are the same for all."""
        start = time.perf_counter()
        ctx = tm.extract_context(request.headers)
        with self.tracer.start_as_current_span(f"{request.method} {request.path}", context=ctx,
                                               kind=tm.trace.SpanKind.SERVER) as span:
            rm = grant = None
            completion_tokens = 0
            try:
                with self.tracer.start_as_current_span(tm.SPAN_ADMISSION + ".auth"):
                    key = await self.auth.authenticate(credentials(request.headers))
                call = await self._prepare(prepare, body, key)
                gen = call.gen
                grant = await self.auth.acquire(key, len(gen.prompt_ids))
                gen.priority, gen.tenant = self.auth.placement(key, gen.priority)
                gen.session_id = request.headers.get("x-session-id") or gen.session_id
                tm.set_request_attributes(span, model=call.model, operation=call.operation, max_tokens=gen.max_tokens,
                                          temperature=gen.sampling.temperature, top_p=gen.sampling.top_p,
                                          seed=gen.sampling.seed, stream=call.stream, session_id=gen.session_id)
                gen.trace_context = tm.inject_context()
                rm = self.metrics.request(call.model, start, api=api)
                if gen.session_id and not self.dispatcher.router.knows(gen.session_id):
                    await self.dispatcher.pool.fresh_blocks()  # another replica may have routed its last turn
                relay = Relay(self.dispatcher, gen, await self.dispatcher.open(gen), self.metrics,
                              wait_s=self.cfg.server.migration_wait_s)
                span.set_attribute(tm.PULSE_WORKER, relay.first_worker.worker_id)
                try:
                    if call.stream:
                        return await self._stream(request, call.events, relay, rm, span)
                    return await self._whole(call.events, relay, rm, span)
                finally:
                    completion_tokens = rm.tokens
                    relay.close()
            except APIError as e:
                if rm is not None:
                    rm.finish(e.status)
                else:
                    self.metrics.record_request(self.cfg.model.name, e.status, time.perf_counter() - start, api=api)
                span.set_attribute("http.response.status_code", e.status)
                raise
            finally:
                if rm is not None:
                    rm.finish(499)  # no-op when the request already finished; else the client left
                if grant is not None:
                    await self.auth.release(grant, completion_tokens)

    async def _whole(self, events: Events, relay: Relay, rm, span) -> web.Response:
        parts: list[str] = []
        lps: list[TokenLogprob] | None = None
        final: Chunk | None = None
        try:
            async for batch in relay.batches():
                for c in batch:
                    rm.chunk(len(c.token_ids))
                    parts.append(c.text)
                    if c.logprobs is not None:
                        lps = (lps or []) + c.logprobs
                    if c.finish_reason is not None:
                        final = c
                        break
                if final is not None:
                    break
        except Exception as e:
            raise APIError(503, f"generation failed mid-way: {e}", code="worker_failed") from None
        if final is None or final.finish_reason == "error":
            msg = final.error if final and final.error else "the worker stream ended without a result"
            raise APIError(503, f"generation failed: {msg}", code="worker_failed")
        usage = final.usage or Usage()
        body = await events.whole("".join(parts), _finish(final), usage, lps)
        rm.finish(200, usage)
        tm.set_usage_attributes(span, usage, _finish(final))
        return web.Response(body=_json.encode(body), content_type="application/json",
                            headers={"x-pulse-worker": relay.first_worker.worker_id})

    async def _stream(self, request: web.Request, events: Events, relay: Relay, rm, span) -> web.StreamResponse:
        """Relay as SSE. Chunks that arrived together leave in one write (one syscall, not one per token), and
        their text in one event when they carry no logprobs: a stream the gateway is behind on catches up in
        fewer, longer deltas (less to frame here and to parse at the client), while one it keeps up with is
        unchanged, an event per chunk. The first batch goes out as soon as it arrives; the last events leave
        with the stream's end, so a client that stops reading at `[DONE]` has read the whole response and
        keeps its connection."""
        out = SSEResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                   "x-pulse-worker": relay.first_worker.worker_id})
        await out.prepare(request)
        is_first = True
        try:
            async for batch in relay.batches():
                rm.chunk(sum(len(c.token_ids) for c in batch))
                pending, is_first, final = _batch_events(events, batch, is_first)
                if final is None:
                    if pending:
                        await out.write(b"".join(pending))
                    continue
                if final.finish_reason == "error":
                    rm.finish("stream_error")
                    pending.append(events.error(final.error or "generation failed"))
                else:
                    usage = final.usage or Usage()
                    pending.append(await events.end(_finish(final), usage))
                    rm.finish(200, final.usage)
                    tm.set_usage_attributes(span, usage, _finish(final))
                await out.write_eof(b"".join(pending))
                return out
            rm.finish("stream_error")
            await _sse_error(out, events, "the worker stream ended without a result")
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client left: closing the upstream (finally in respond) cancels the generation
        except Exception as e:  # after the first byte: one in-band error event, then close
            log.warning("stream %s failed: %s", relay.gen.request_id, e)
            rm.finish("stream_error")
            await _sse_error(out, events, "the generation failed mid-stream")
        return out


class SSEResponse(web.StreamResponse):
    """A stream whose headers leave with its first events, in one write: the first batch is already in hand
    when the stream opens, and on loopback each write costs the receiver's TCP processing too."""

    _send_headers_immediately = False  # aiohttp's own switch (web.Response turns it off the same way)


OFF_LOOP_BYTES = 32 << 10  # a body this long holds a prompt of ~8k tokens or more


async def parse_off_loop(parse, body: bytes):
    """`parse(body)`, on a thread when the body is long: templating and tokenizing a long prompt takes
    milliseconds (~15 ms for 9k tokens), during which no other stream on this event loop would move. A
    short one parses inline: the thread hop would cost more than the parse."""
    if len(body) < OFF_LOOP_BYTES:
        return parse(body)
    return await asyncio.to_thread(parse, body)


def _batch_events(events: Events, batch: list[Chunk], first: bool) -> tuple[list[bytes], bool, Chunk | None]:
    """The delta events of chunks that arrived together, up to the stream's final chunk (a finish reason, or
    "error"), which is returned for the caller to end the stream with (an error chunk's text is not sent);
    and whether the next delta is still the first. Consecutive plain-text chunks make one delta; the first
    delta and a chunk with logprobs keep their own event, so logprobs stay aligned with their tokens."""
    pending: list[bytes] = []
    text: list[str] = []
    final = None
    for c in batch:
        if c.finish_reason == "error":
            final = c
            break
        if c.logprobs or first:
            if text:
                pending.append(events.delta("".join(text), None, False))
                text = []
            pending.append(events.delta(c.text, c.logprobs, first))
            first = False
        elif c.text:
            text.append(c.text)
        if c.finish_reason is not None:
            final = c
            break
    if text:
        pending.append(events.delta("".join(text), None, False))
    return pending, first, final


def _finish(c: Chunk) -> str:
    return "stop" if c.finish_reason in ("stop", "cancelled") else c.finish_reason or "stop"


def _event(obj: dict) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def _error_event(message: str) -> bytes:
    return _event(error_body(503, message, None, "worker_failed"))


async def _sse_error(out: web.StreamResponse, events: Events, message: str) -> None:
    try:
        await out.write_eof(events.error(message))
    except (ConnectionResetError, RuntimeError):
        pass
