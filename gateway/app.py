"""The gateway's HTTP application (aiohttp): routes, error mapping, and the server it runs in."""
from __future__ import annotations

import logging
import socket
import time

from aiohttp import web

from gateway.anthropic_api import MessagesAPI, anthropic_error_response
from gateway.completions import CompletionService, credentials
from gateway.errors import APIError, error_response
from gateway.open_guard import open_guard
from gateway.pool import WorkerPool
from gateway.response_store import open_response_store
from gateway.responses_api import ResponsesAPI
from gateway.status import StatusBoard

log = logging.getLogger("pulse.gateway")

# Connections the kernel completes for a replica before it accepts them (the kernel caps it at net.core.somaxconn).
# Past it, a client's SYN is dropped and retried a second later: with aiohttp's default (128) a burst of 256 agents
# connecting to one replica on a busy 2-core box saw 10% of first tokens ~1 s late (BENCHMARKS.md, issue 20).
LISTEN_BACKLOG = 4096

# curl -d sends application/x-www-form-urlencoded and many scripts send text/plain: parse those as JSON too
_JSON_TYPES = ("application/json", "", "application/x-www-form-urlencoded", "text/plain")


class Gateway:
    """Holds the gateway's parts and builds its aiohttp application."""

    def __init__(self, service: CompletionService, pool: WorkerPool, *, metrics):
        self.service, self.pool, self.metrics = service, pool, metrics
        self.draining = False
        self.created = int(time.time())

    def app(self) -> web.Application:
        cfg = self.service.cfg.server
        # the guard runs inside _errors, which renders its refusals in each API's error shape
        app = web.Application(client_max_size=cfg.max_body_bytes,
                              middlewares=[self._errors, open_guard(self.service.auth, cfg.host)])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        # the Responses and Messages APIs: adapters onto the same chat core (gateway/completions.py)
        ResponsesAPI(self.service, open_response_store(self.service.cfg)).add_routes(app.router, self._body)
        MessagesAPI(self.service).add_routes(app.router, self._body)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/pulse/workers", self.workers)
        # the status page: GET / and /ui, its JSON at /pulse/status
        dispatcher = self.service.dispatcher
        StatusBoard(self.pool, self.metrics, dispatcher.gate, dispatcher.index, self.service.auth,
                    models=lambda: [m.name for m in self.service.models.models]).attach(app)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        # each API's errors in its own shape: Anthropic's on /v1/messages*, OpenAI's everywhere else
        render = anthropic_error_response if request.path.startswith("/v1/messages") else error_response
        try:
            return await handler(request)
        except APIError as e:
            return render(e)
        except web.HTTPRequestEntityTooLarge as e:
            return render(APIError(413, f"request body too large: {e.text}", code="body_too_large"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return render(APIError(e.status, e.reason or "error", code=e.reason.lower().replace(" ", "_")))
        except (ConnectionResetError,):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return render(APIError(500, "internal error", code="internal_error"))

    async def _body(self, request: web.Request) -> bytes:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="draining", headers={"Retry-After": "5"})
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype not in _JSON_TYPES and not ctype.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json; got {ctype!r}", code="unsupported_media_type")
        return await request.read()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.service.respond(request, "chat", await self._body(request))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.service.respond(request, "completion", await self._body(request))

    def _model_card(self, name: str | None = None) -> dict:
        """A served model as /v1/models shows it (`name`: by name or alias; empty: the first served)."""
        model = self.service.models.get(name) if name else self.service.models.default
        return {"id": model.name, "object": "model", "created": self.created, "owned_by": "pulse"}

    async def models(self, request: web.Request) -> web.Response:
        await self.service.auth.authenticate(credentials(request.headers))  # a key when keys exist, as OpenAI's
        cards = [self._model_card(m.name) for m in self.service.models.models]
        return web.json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        await self.service.auth.authenticate(credentials(request.headers))
        return web.json_response(self._model_card(request.match_info["model"]))  # 404 model_not_found if unknown

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        workers = {w.worker_id: w.healthy for w in self.pool.workers.values()}
        ok = self.pool.any_healthy()
        return web.json_response({"status": "ok" if ok else "unavailable", "workers": workers}, status=200 if ok else 503)

    async def workers(self, request: web.Request) -> web.Response:
        """Each worker's address, health and last reported load (what routing sees). Admin scope when keyed."""
        import msgspec

        await self.service.auth.authenticate(request.headers.get("Authorization"), admin=True)
        now = time.monotonic()
        rows = [{"worker_id": w.worker_id, "url": w.info.url, "node_id": w.info.node_id, "device": w.info.device,
                 "backend": w.info.backend, "model": w.info.model,
                 "healthy": w.healthy, "routable": w.routable(now), "inflight": w.inflight,
                 "stats": msgspec.to_builtins(w.stats)}
                for w in self.pool.workers.values()]
        return web.json_response({"workers": rows})

    async def metrics_page(self, request: web.Request) -> web.Response:
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})


async def start_server(app: web.Application, host: str, port: int, *, reuse_port: bool = True,
                       max_header_bytes: int = 16384) -> tuple[web.AppRunner, int]:
    """Serve `app`; several gateway processes can share one port (SO_REUSEPORT) so the kernel spreads clients."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, max_field_size=max_header_bytes,
                           max_line_size=max_header_bytes)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    site = web.SockSite(runner, sock, backlog=LISTEN_BACKLOG)  # SockSite listens again: its default would be 128
    await site.start()
    return runner, sock.getsockname()[1]
