"""An open gateway (no keys, loopback) refuses what a web page could send it: cross-site requests (CSRF)
and requests for another name (DNS rebinding). The real `pulse serve` of the API tests (load-test backend)."""
from __future__ import annotations

import json
import urllib.request

import aiohttp
import pytest

CHAT = "/v1/chat/completions"


async def _post(base: str, path: str, body: bytes, headers: dict) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as http:
        async with http.post(base + path, data=body, headers=headers) as r:
            text = await r.text()
            return r.status, r.headers, text


def _chat_body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def model(loadtest_server):
    with urllib.request.urlopen(loadtest_server.base + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
async def test_bodies_a_browser_sends_without_preflight_are_415(loadtest_server, model, path, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as http:
        async with http.post(loadtest_server.base + path, data=_chat_body(model), headers=headers) as r:
            body = await r.json()
            assert r.status == 415, body
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # Anthropic's shape
    else:
        assert body["error"]["code"] == "unsupported_media_type" and {"message", "type", "param"} <= set(body["error"])


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "10.1.2.3"])
async def test_a_foreign_host_is_421(loadtest_server, model, host):
    status, _, text = await _post(loadtest_server.base, CHAT, _chat_body(model),
                                  {"Content-Type": "application/json", "Host": host})
    assert status == 421 and json.loads(text)["error"]["code"] == "misdirected_request", text
    async with aiohttp.ClientSession() as http:
        async with http.get(loadtest_server.base + "/", headers={"Host": host}) as r:
            assert r.status == 421  # a rebinding page cannot read the status page either


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example", "null"])
async def test_a_cross_site_origin_is_403(loadtest_server, model, origin):
    status, _, text = await _post(loadtest_server.base, CHAT, _chat_body(model),
                                  {"Content-Type": "application/json", "Origin": origin})
    assert status == 403 and json.loads(text)["error"]["code"] == "cross_site_request", text


async def test_local_clients_and_the_status_page_pass(loadtest_server, model):
    port = loadtest_server.port
    for host, origin in [(f"127.0.0.1:{port}", None), (f"localhost:{port}", f"http://localhost:{port}"),
                         (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}")]:
        headers = {"Content-Type": "application/json; charset=utf-8", "Host": host,
                   "Authorization": "Bearer unused", **({"Origin": origin} if origin else {})}
        status, _, text = await _post(loadtest_server.base, CHAT, _chat_body(model), headers)
        assert status == 200, text
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")


async def test_headers_are_bounded(loadtest_server, model):
    """An x-session-id (or any header) past server.max_header_bytes is refused before any handler runs;
    one just under it is served (the router keys a long id by its digest)."""
    headers = {"Content-Type": "application/json"}
    status, _, _ = await _post(loadtest_server.base, CHAT, _chat_body(model), {**headers, "x-session-id": "s" * 17_000})
    assert status in (400, 431)
    status, _, text = await _post(loadtest_server.base, CHAT, _chat_body(model), {**headers, "x-session-id": "s" * 15_000})
    assert status == 200, text
