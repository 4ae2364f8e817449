"""What keeps web pages out of an open gateway (no keys, loopback bind): an aiohttp middleware.

An open gateway trusts whoever can reach it, which on loopback is this machine's own programs. A web
page the user visits can reach it too, through the browser: a form or a `fetch` with a text/plain or
typeless body needs no CORS preflight (cross-site request forgery), and a page whose DNS name is
rebound to 127.0.0.1 reads the answers as its own (DNS rebinding). So while the gateway is open:

- the Host header must name this machine: `localhost` (or `*.localhost`), a loopback address, or the
  bind address itself; otherwise 421 (a rebinding page's requests carry its own name);
- a request with an Origin header must come from such an origin too; otherwise 403 (every cross-site
  POST a browser sends carries its Origin; same-origin pages, like the status page, pass);
- a request with a body (POST, PUT, PATCH) must be `application/json` (or `*+json`); otherwise 415 (the
  body types a browser may send cross-site without asking are form, multipart, text/plain and none).

Once keys exist every request needs one, which a browser cannot add cross-site without a preflight
this server never grants, and these checks step aside (keyed gateways sit behind public names).

    app = web.Application(middlewares=[errors, open_guard(auth, bind_host)])   # errors render the APIError
"""
from __future__ import annotations

from functools import lru_cache
from urllib.parse import urlsplit

from aiohttp import web

from gateway.auth import KeyAuth, is_loopback
from gateway.errors import APIError

_BODY_METHODS = ("POST", "PUT", "PATCH")


def local_name(host: str, bind_host: str) -> bool:
    """Whether `host` (no port) names this machine's loopback: what an open gateway answers to."""
    host = host.strip().strip("[]").rstrip(".").lower()
    return is_loopback(host) or host.endswith(".localhost") or host == bind_host.strip("[]").lower()


@lru_cache(maxsize=256)  # bounded: Host is client input; every request of a client sends the same one
def _local_host(header: str, bind_host: str) -> bool:
    """Whether a Host header value names this machine (parsing it costs more than the rest of the guard)."""
    return local_name(_host_of(header), bind_host)


def _host_of(header: str) -> str:
    """The host part of a Host header value: `name`, `name:port`, `[v6]` or `[v6]:port`."""
    return urlsplit("//" + header).hostname or ""


def open_guard(auth: KeyAuth, bind_host: str):
    @web.middleware
    async def guard(request: web.Request, handler):
        if await auth.is_open():
            check(request, bind_host)
        return await handler(request)

    return guard


def check(request: web.Request, bind_host: str) -> None:
    """Raise the APIError an open gateway answers `request` with, if any."""
    host = request.headers.get("Host")
    if host is not None and not _local_host(host, bind_host):
        raise APIError(421, f"this gateway has no API keys and answers only to loopback names, not {host!r}; "
                       "create a key (`pulse keys create`) to serve it under another name", code="misdirected_request")
    origin = request.headers.get("Origin")
    if origin is not None and not local_name(urlsplit(origin).hostname or "", bind_host):
        raise APIError(403, f"cross-site request from {origin!r} refused: this gateway has no API keys, so only "
                       "programs on this machine and its own pages may call it", code="cross_site_request")
    if request.method in _BODY_METHODS:
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json; got {ctype or 'none'!r} "
                           "(with curl: -H 'Content-Type: application/json')", code="unsupported_media_type")
