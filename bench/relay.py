"""The baseline for gateway overhead: a tiny streaming upstream and a plain aiohttp relay in front of it.

- `upstream` answers OpenAI chat/completions requests by streaming `tokens` content events as SSE (the shape
  Pulse's load-test backend streams: a role delta, one event per token, a finish event, a usage event when
  asked, `data: [DONE]`), at `rate` tokens/s per stream (0: as fast as possible).
- `relay` forwards any request to the upstream and copies the response bytes through as they arrive: the
  least a gateway can do. Pulse's added time to first token is compared with this relay's, in the same run.

    python -m bench.relay upstream --port 9101 [--tokens 16] [--rate 0]
    python -m bench.relay relay --port 9102 --upstream http://127.0.0.1:9101
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from bench import loops

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def stream_events(chat: bool, model: str, n: int, include_usage: bool) -> list[dict]:
    """The OpenAI stream events for n tokens (without the closing [DONE])."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}

    def choice(text: str | None, finish: str | None, role: bool = False) -> dict:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish}

    events = [{**base, "choices": [choice(None, None, role=True)]}] if chat else []
    events += [{**base, "choices": [choice(f" tok{i}", None)]} for i in range(n)]
    events.append({**base, "choices": [choice(None, "length")]})
    if include_usage:
        events.append({**base, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n,
                                                         "total_tokens": 4 + n}})
    return events


def upstream_app(tokens: int = 16, rate: float = 0.0, ttft: float = 0.0) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "malformed JSON", "type": "invalid_request_error",
                                                "param": None, "code": None}}, status=400)
        chat = request.path.endswith("/chat/completions")
        n = min(tokens, int(body.get("max_tokens") or tokens))
        model = str(body.get("model", "upstream"))
        if not body.get("stream"):
            text = "".join(f" tok{i}" for i in range(n))
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            return web.json_response({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                      "model": model, "choices": [choice],
                                      "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}})
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        first_token = 1 if chat else 0  # a chat stream opens with its role event
        for i, event in enumerate(stream_events(chat, model, n, usage)):
            # the role event and the first token go at once, later tokens at the rate, and the finish and usage
            # events right after the last token, as Pulse's load-test backend sends its stream; with no rate the
            # loop still gets a turn before each later token, as the load-test backend gives it (a real server
            # sends a token a step)
            if first_token < i < first_token + n:
                await asyncio.sleep(1.0 / rate if rate else 0)
            elif ttft and i == first_token:  # an engine's prefill before the first token
                await asyncio.sleep(ttft)
            await resp.write(sse(event))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    return app


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "upstream", "object": "model", "owned_by": "bench"}]})


def relay_app(upstream: str) -> web.Application:
    upstream = upstream.rstrip("/")

    async def start(app: web.Application) -> None:
        # one pooled session, no total timeout: streams last as long as the upstream streams
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               timeout=aiohttp.ClientTimeout(total=None))

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app["session"].request(request.method, upstream + request.path_qs,
                                                  data=body, headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/octet-stream")})
            await resp.prepare(request)
            async for data in up.content.iter_any():  # bytes through as they arrive, no re-framing
                await resp.write(data)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    up = sub.add_parser("upstream", help="stream `tokens` OpenAI SSE events per request")
    up.add_argument("--tokens", type=int, default=16)
    up.add_argument("--rate", type=float, default=0.0, help="tokens/s per stream; 0 = as fast as possible")
    up.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token (0: at once)")
    rel = sub.add_parser("relay", help="forward everything to --upstream")
    rel.add_argument("--upstream", required=True)
    for p in (up, rel):
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--loop", choices=loops.CHOICES, default="auto", help="event loop (auto: uvloop if installed)")
    args = ap.parse_args(argv)
    app = upstream_app(args.tokens, args.rate, args.ttft) if args.role == "upstream" else relay_app(args.upstream)
    # access_log=None: logging every request would be most of what a relay this small costs; the backlog is
    # the gateway's (1024), so a thousand clients connecting at once are not dropped here and not there
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None, loop=loops.new_loop(args.loop),
                backlog=1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
