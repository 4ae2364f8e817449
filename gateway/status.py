"""The status page: `GET /` and `/ui` serve it (gateway/ui/), `GET /pulse/status` feeds it JSON.

    board = StatusBoard(pool, metrics, gate, index, auth, models=lambda: ["gemma-3-270m"])  # served models
    board.attach(app)     # routes, the error recorder (middleware), the sampler (a reading every 2 s)

What /pulse/status shows comes from what the gateway already keeps: the workers' polled stats
(gateway/pool.py), the metrics objects (gateway/metrics.py), the admission queue and the prefix index.
Gateway figures over the last minute and the 15-minute charts come from gateway/status_history.py.
Access: the page itself holds nothing and is always served; /pulse/status is fleet detail and needs an
admin key once keys exist (open on a keyless loopback gateway, as every endpoint is). Nothing a tenant
sent appears in it: recent errors carry the path, status and code, and a message only for the gateway's
own failures (5xx) and rate limits (429), whose text the gateway wrote.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from importlib import resources

from aiohttp import web

from gateway.errors import APIError
from gateway.router import load_of
from gateway.status_history import History, Reading
from policy.admission import worker_queue

log = logging.getLogger("pulse.gateway.status")

ASSETS = {"status.js": "text/javascript", "status.css": "text/css"}
# The page loads nothing from elsewhere (the boxes are often offline) and runs no inline code.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
MESSAGE_STATUSES = (429,)  # besides 5xx: statuses whose error text is shown (the gateway wrote all of it)
MAX_MESSAGE = 200


def _asset(name: str) -> bytes:
    return resources.files("gateway").joinpath("ui", name).read_bytes()


class StatusBoard:
    """`pool`: gateway.pool.WorkerPool; `metrics`: GatewayMetrics; `gate`: the AdmissionGate (its queue);
    `index`: the PrefixIndex routing asks, or None; `auth`: KeyAuth; `models`: the served model names."""

    def __init__(self, pool, metrics, gate, index, auth, *, models: Callable[[], list[str]],
                 sample_s: float = 2.0, history_s: float = 900.0, max_errors: int = 50):
        self.pool, self.metrics, self.gate, self.index, self.auth = pool, metrics, gate, index, auth
        self.models = models
        # every 2 s: a reading collects the metrics through prometheus_client's collect(), ~0.8 ms of CPU on
        # the event loop with two models served (2-core dev box); the page's figures stay at most 2 s old
        self.sample_s = sample_s
        self.history = History(sample_s=sample_s, history_s=history_s)
        self.errors: deque[dict] = deque(maxlen=max_errors)
        self.counts = {"requests": 0, "ok": 0, "client_error": 0, "rate_limited": 0, "server_error": 0}
        self.started = time.time()
        self._sampler: asyncio.Task | None = None
        self._page = _asset("index.html")
        self._assets = {name: _asset(name) for name in ASSETS}

    def attach(self, app: web.Application) -> None:
        for path in ("/", "/ui", "/ui/"):
            app.router.add_get(path, self.page)
        app.router.add_get("/ui/{name}", self.asset)
        app.router.add_get("/pulse/status", self.status)
        app.middlewares.append(self.observe)  # inside the error mapper: sees the APIError itself
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    # ---- HTTP ----------------------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=self._page, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self._assets:
            raise APIError(404, f"no such file: /ui/{name}", code="not_found")
        return web.Response(body=self._assets[name], content_type=ASSETS[name], charset="utf-8",
                            headers=PAGE_HEADERS)

    async def status(self, request: web.Request) -> web.Response:
        key = await self.auth.authenticate(request.headers.get("Authorization"), admin=True)
        since = request.query.get("since")
        try:
            since_t = float(since) if since is not None else None
        except ValueError:
            raise APIError(400, "since must be a number (seconds since the epoch)", param="since",
                           code="invalid_value") from None
        body = self.snapshot(since_t)
        body["access"] = "open" if key is None else "admin"
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    @web.middleware
    async def observe(self, request: web.Request, handler):
        """Count API requests by outcome and keep the last errors (POST /v1/... only: the page's own polls
        and scrapes are not traffic)."""
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        try:
            response = await handler(request)
        except APIError as e:
            self.record(request.path, e.status, e.code, e.message)
            raise
        except web.HTTPException as e:
            self.record(request.path, e.status, (e.reason or "error").lower().replace(" ", "_"), e.reason)
            raise
        except asyncio.CancelledError:
            self.record(request.path, 499, "client_closed", None)
            raise
        except Exception:
            self.record(request.path, 500, "internal_error", "internal error")
            raise
        self.record(request.path, response.status, None, None)
        return response

    def record(self, path: str, status: int, code: str | None, message: str | None) -> None:
        self.counts["requests"] += 1
        kind = ("ok" if status < 400 else "rate_limited" if status == 429 else
                "server_error" if status >= 500 else "client_error")
        self.counts[kind] += 1
        if status < 400 or status == 499:
            return
        shown = message if (status >= 500 or status in MESSAGE_STATUSES) and message else None
        self.errors.append({"time": round(time.time(), 3), "path": path[:64], "status": status,
                            "code": code or "", "message": shown[:MAX_MESSAGE] if shown else None})

    # ---- sampling ------------------------------------------------------------------------------
    async def _start(self, app: web.Application) -> None:
        self._sampler = asyncio.get_running_loop().create_task(self._sample_loop())

    async def _stop(self, app: web.Application) -> None:
        if self._sampler is not None:
            self._sampler.cancel()

    async def _sample_loop(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # the page is a view: a bad reading must not stop the next one
                log.exception("status sample failed")
            await asyncio.sleep(self.sample_s)

    def sample(self) -> None:
        workers = list(self.pool.workers.values())
        m = self.metrics
        counts = dict(self.counts)
        counts.update(prompt_tokens=_total(m.prompt_tokens), cached_tokens=_total(m.cached_tokens),
                      generated_tokens=_total(m.generated_tokens), stream_errors=_total(m.requests, "stream_error"),
                      index_ratio_sum=_total(m.prefix_hit_ratio, suffix="_sum"),
                      index_lookups=_total(m.prefix_hit_ratio, suffix="_count"))
        self.history.add(Reading(
            mono=time.monotonic(), wall=time.time(),
            tokens_per_s=sum(w.stats.tokens_per_s for w in workers if w.healthy),
            waiting=self.gate.depth + sum(w.stats.waiting for w in workers if w.healthy),
            ttft=_buckets(m.ttft), itl=_buckets(m.itl), counts=counts))

    # ---- the JSON ------------------------------------------------------------------------------
    def snapshot(self, since: float | None = None) -> dict:
        held = self.index.held() if self.index is not None else None
        minute = self.history.window(60)
        return {
            "time": round(time.time(), 3),
            "uptime_s": round(time.time() - self.started, 1),
            "models": self.models(),
            "gateway": self._gateway(minute),
            "workers": [self._worker(w, held) for w in self.pool.workers.values()],
            "index": self._index(minute, held),
            "errors": list(self.errors)[::-1],
            "series": {"fields": ["time", "tokens_per_s", "ttft_p50_ms", "waiting"],
                       "points": self.history.points(since)},
        }

    def _gateway(self, minute: dict) -> dict:
        c, rates = minute["counts"], minute["rates"]
        return {"window_s": minute["seconds"], "requests_per_s": rates.get("requests", 0.0),
                "ttft_ms": minute["ttft_ms"], "itl_ms": minute["itl_ms"],
                "last_minute": {k: int(c.get(k, 0)) for k in
                                ("requests", "ok", "client_error", "rate_limited", "server_error", "stream_errors")},
                "total": dict(self.counts), "queue_depth": self.gate.depth,
                "in_flight": sum(w.inflight for w in self.pool.workers.values()),
                "generated_tokens_per_s": rates.get("generated_tokens", 0.0)}

    def _index(self, minute: dict, held: dict[str, int] | None) -> dict:
        c = minute["counts"]
        lookups, prompt = c.get("index_lookups", 0), c.get("prompt_tokens", 0)
        return {"kind": type(self.index).__name__ if self.index is not None else None,
                "blocks": sum(held.values()) if held is not None else None,
                "match_ratio": round(c["index_ratio_sum"] / lookups, 4) if lookups else None,
                "cached_ratio": round(c["cached_tokens"] / prompt, 4) if prompt else None,
                "lookups": int(lookups)}

    def _worker(self, w, held: dict[str, int] | None) -> dict:
        s, info, now = w.stats, w.info, time.monotonic()
        drafted, accepted = sum(s.drafted_by_position), sum(s.accepted_by_position)
        return {
            "id": w.worker_id, "node": info.node_id, "device": info.device, "device_id": info.device_id,
            "backend": info.backend, "models": [info.model] if info.model else self.models(),
            "healthy": w.routable(now), "why": _why(w, now),
            "running": s.running, "waiting": s.waiting, "slots": s.slots, "inflight": w.inflight,
            # requests the gateway sends it beyond its slots (policy.admission.worker_queue)
            "queue": worker_queue(load_of(w), self.gate.cfg),
            "kv_blocks_used": s.kv_blocks_used, "kv_blocks_total": s.kv_blocks_total, "block_size": s.block_size,
            "tokens_per_s": round(s.tokens_per_s, 2), "prefill_tokens_per_s": round(s.prefill_tokens_per_s, 2),
            "generated_tokens": s.generated_tokens, "preemptions": s.preemptions, "restarts": s.restarts,
            "speculation_k": s.speculation_k,
            "acceptance": round(accepted / drafted, 4) if drafted else None, "drafted": drafted,
            "blocks_indexed": held.get(w.worker_id, 0) if held is not None else None,
            "seen_s_ago": round(now - w.last_seen, 1) if w.last_seen else None,
        }


def _why(w, now: float) -> str:
    """Why a worker is not taking requests ("" when it is)."""
    if now < w.open_until:
        return f"circuit open after {w.failures} failed requests; retried in {w.open_until - now:.0f} s"
    if not w.healthy and not w.stats.healthy:
        return "the backend reports itself unhealthy"
    if not w.healthy:
        seen = f"{now - w.last_seen:.0f} s ago" if w.last_seen else "never"
        return f"its stats endpoint does not answer (last seen {seen})"
    return ""


def _total(metric, status: str | None = None, suffix: str = "_total") -> float:
    """Sum of a metric's samples over its labels (models); `status`: only that status label."""
    return sum(s.value for fam in metric.collect() for s in fam.samples
               if s.name.endswith(suffix) and (status is None or s.labels.get("status") == status))


def _buckets(histogram) -> tuple[tuple[float, float], ...]:
    """A histogram's cumulative buckets summed over its labels (models): ((le, count), ...) ascending."""
    by_le: dict[float, float] = {}
    for fam in histogram.collect():
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                by_le[le] = by_le.get(le, 0.0) + s.value
    return tuple(sorted(by_le.items()))
