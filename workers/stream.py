"""A worker's token stream over a direct HTTP channel (not a Ray call per chunk).

POST /generate takes a GenerateRequest (JSON) and answers with one Chunk (JSON) per line; GET /stats
answers BackendStats. Only the gateway may call: every request carries `Authorization: Bearer <secret>`
(the worker's channel secret, made here and handed to gateways through Ray in WorkerInfo), compared in
constant time; anything else gets 401. The worker checks every bound of a GenerateRequest itself
(workers/request_limits.py) and takes bodies no larger than a within-bounds request needs, and it refuses a
request naming a model it does not hold (421 `model_not_held`) rather than generate with the wrong one. Each chunk
goes out in one write as the backend yields it, the first at once; a backend coalesces what piled up for a stream
into one chunk (the engine's does), so a busy worker writes fewer, larger lines. A gateway that closes the
connection cancels the generation: aiohttp cancels the handler and the backend's iterator is closed in
`finally`, freeing the slot and KV blocks.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import time

import cachetools
from aiohttp import web

from workers.protocol import Backend, BackendError, encode, request_decoder
from workers.protocol import telemetry as tm
from workers.request_limits import RequestLimits

log = logging.getLogger("pulse.worker.stream")
# A gateway's word on its queue counts this long after its stats poll (every 0.5 s): a replica that stopped is
# forgotten, and at most GATEWAYS_KEPT are remembered (only gateways, holding the secret, reach /stats)
GATEWAY_REPORT_TTL_S = 3.0
GATEWAYS_KEPT = 64


class StreamServer:
    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0, *, tracer=None,
                 worker_id: str = "", block_log=None, limits: RequestLimits | None = None,
                 secret: str | None = None, models: tuple[str, ...] = ()):
        self.block_log = block_log
        self.models = models  # the ids of the model it holds (served name, aliases); empty: any request's
        self.limits = limits or RequestLimits(context_length=1 << 20)
        self.secret = secret or secrets.token_urlsafe(32)
        self._expected = f"Bearer {self.secret}".encode()
        self.backend, self.host, self.port = backend, host, port
        self.tracer = tracer or tm.trace.get_tracer("pulse.worker")
        self.worker_id = worker_id
        self._runner: web.AppRunner | None = None
        self.draining = False
        # each gateway's queue as its latest stats poll gave it: {gateway id: (requests waiting there, its head for
        # this worker as (priority, when it came on this worker's clock) or None)}
        self._gateways: cachetools.TTLCache = cachetools.TTLCache(GATEWAYS_KEPT, GATEWAY_REPORT_TTL_S)

    async def start(self) -> str:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._authorize])
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/blocks", self.blocks)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://{self.host}:{self.port}"

    @web.middleware
    async def _authorize(self, request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):
            return _error(401, "this worker answers only its gateway", "unauthorized")
        return await handler(request)

    async def close(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def stats(self, request: web.Request) -> web.Response:
        """The backend's stats. A gateway polling with `?gateway=<its id>&waiting=<its queue>` also says how many
        requests wait in its admission queue, and is told how many wait in the others' (`gateways_waiting`) and how
        many others there are (`other_gateways`), so that each replica takes its share of this worker's places
        (policy.admission.over_share) and the replicas' queues are one (policy.admission.queue_capacity). With
        `&head=<priority>:<ms>` it says its queue's head for this worker has that priority and has waited that
        long, and is told the others' head that goes first (`gateways_head_priority`, `gateways_head_waited_s`):
        the replicas serve this worker's places in one order (policy.admission.gateway_order)."""
        gateway = request.query.get("gateway", "")[:64]
        now = time.monotonic()
        if gateway:
            try:
                waiting = max(0, min(int(request.query.get("waiting", "0")), 1 << 20))
                head = request.query.get("head")  # "<priority>:<ms it has waited>": its head that waits for this one
                if head is not None:
                    priority, waited_ms = head.split(":")
                    head = (max(-1000, min(int(priority), 1000)), now - max(0, min(int(waited_ms), 1 << 30)) / 1e3)
            except ValueError:
                return _error(400, "waiting must be an integer and head <priority>:<waited ms>", "bad_request")
            self._gateways[gateway] = (waiting, head)
        stats = self.backend.stats()
        if self.draining:
            stats.healthy = False
        others = [report for g, report in self._gateways.items() if g != gateway]
        stats.gateways_waiting, stats.other_gateways = sum(n for n, _ in others), len(others)
        heads = [head for _, head in others if head is not None]
        stats.gateways_head_priority, stats.gateways_head_waited_s = None, 0.0
        if heads:  # highest priority, then the earliest come
            priority, since = min(heads, key=lambda h: (-h[0], h[1]))
            stats.gateways_head_priority, stats.gateways_head_waited_s = priority, max(0.0, now - since)
        return web.Response(body=encode(stats), content_type="application/json")

    async def blocks(self, request: web.Request) -> web.Response:
        """KV block events after `since` (workers/blocklog.py), for gateways with an in-process index."""
        if self.block_log is None:
            return _error(404, "this worker publishes block events to Redis", "no_block_log")
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return _error(400, "since must be an integer", "bad_request")
        return web.Response(body=encode(self.block_log.since(since)), content_type="application/json")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return _error(503, "worker is draining", "draining")
        try:
            req = request_decoder.decode(await request.read())
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"generate request over {self.limits.max_body_bytes} bytes", "body_too_large")
        except Exception as e:
            return _error(400, f"bad generate request: {e}", "bad_request")
        problem = self.limits.problem(req)
        if problem:
            return _error(400, f"generate request out of bounds: {problem}", "out_of_bounds")
        if req.model and self.models and req.model not in self.models:
            # 421 Misdirected Request: the gateway sent it to the wrong worker (its view of the workers is stale)
            return _error(421, f"worker {self.worker_id} holds model {self.models[0]!r}, not {req.model!r}",
                          "model_not_held")
        parent = tm.extract_context(req.trace_context)
        # prefill: arrival (queue wait included) to the first chunk; decode: first chunk to finish
        with self.tracer.start_as_current_span(tm.SPAN_PREFILL, context=parent) as prefill:
            prefill.set_attribute(tm.PULSE_WORKER, self.worker_id)
            prefill.set_attribute(tm.GEN_AI_USAGE_INPUT_TOKENS, len(req.prompt_ids))
            chunks = self.backend.generate(req)
            try:
                first = await chunks.__anext__()
            except BackendError as e:
                await chunks.aclose()
                return _error(e.status, e.message, e.code)
            except StopAsyncIteration:
                return _error(500, "backend produced no output", "backend_error")
        with self.tracer.start_as_current_span(tm.SPAN_DECODE, context=parent) as decode:
            decode.set_attribute(tm.PULSE_WORKER, self.worker_id)
            tm.first_token_event(decode)
            return await self._relay(request, chunks, first, decode)

    async def _relay(self, request: web.Request, chunks, first, span) -> web.StreamResponse:
        # Chunks are awaited in this handler's own task (no task per chunk): on the per-token path of every
        # stream, a task and a loop turn per chunk were a large part of the worker's CPU per token.
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await resp.prepare(request)
            chunk = first
            while chunk.finish_reason is None:
                await resp.write(encode(chunk) + b"\n")
                chunk = await chunks.__anext__()
            # the final line and the chunked terminator in one write: a gateway that stops reading at the final
            # line finds the terminator already there and keeps the connection (gateway/channel.py)
            await resp.write_eof(encode(chunk) + b"\n")
            _finish_span(span, chunk)
            return resp
        except StopAsyncIteration:
            return resp
        finally:
            await chunks.aclose()


def _finish_span(span, chunk) -> None:
    if chunk.usage is not None:
        tm.set_usage_attributes(span, chunk.usage, chunk.finish_reason)


def _error(status: int, message: str, code: str) -> web.Response:
    return web.Response(status=status, body=encode({"error": {"message": message, "code": code}}),
                        content_type="application/json")
