"""The OpenAI-compatible API through real HTTP against a running `pulse serve` (load-test backend).

Covers every bad-input case of the foundation issue, streaming format, usage, and cancellation on
client disconnect. The real backends end to end: test_agent_api.py (engine and llama-server with the `openai`
client), test_routing_e2e.py, test_speculation.py and the reliability tests.
"""
from __future__ import annotations

import json

import aiohttp

from tests.waiting import until

MODEL = "gemma-3-270m"
CHAT = "/v1/chat/completions"


async def post(base: str, path: str, body, *, raw: bytes | None = None, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(base + path, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
            return r.status, await r.read(), r.headers


def assert_openai_error(status: int, body: bytes, expect_status: int, param: str | None = "*") -> dict:
    assert status == expect_status, body
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    if param != "*":
        assert err["param"] == param, err
    return err


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **kw}


BAD_REQUESTS = [
    # (body, expected status, parameter named)
    (chat(max_tokens=-1), 400, "max_tokens"),
    (chat(max_tokens=0), 400, "max_tokens"),
    (chat(max_completion_tokens=-5), 400, "max_completion_tokens"),
    (chat(temperature=2.5), 400, "temperature"),
    (chat(temperature=-0.1), 400, "temperature"),
    (chat(top_p=0), 400, "top_p"),
    (chat(top_p=1.5), 400, "top_p"),
    (chat(top_k=-1), 400, "top_k"),
    (chat(n=2), 400, "n"),
    (chat(max_tokens="ten"), 400, "max_tokens"),
    (chat(temperature="hot"), 400, "temperature"),
    (chat(stream="yes"), 400, "stream"),
    (chat(stop=["a"] * 100), 400, "stop"),
    (chat(top_logprobs=5), 400, "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (chat(max_draft_tokens=-1), 400, "max_draft_tokens"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ([1, 2, 3], 400, None),
    ("just a string", 400, None),
]


async def test_bad_requests_are_openai_4xx(loadtest_server):
    for body, status, param in BAD_REQUESTS:
        got, raw, _ = await post(loadtest_server.base, CHAT, body)
        assert_openai_error(got, raw, status, param)


async def test_malformed_json_and_empty_body(loadtest_server):
    lone_surrogate = b'{"model": "gemma-3-270m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    for raw in (b"{bad", b"", b'{"model": "gemma-3-270m", "messages": [', b"\xff\xfe{}", b"[" * 200_000,
                lone_surrogate):  # a lone surrogate never reaches the tokenizer (it takes only valid text)
        status, body, _ = await post(loadtest_server.base, CHAT, None, raw=raw)
        assert_openai_error(status, body, 400)


async def test_unknown_model_is_404(loadtest_server):
    status, body, _ = await post(loadtest_server.base, CHAT, chat(model="gpt-5"))
    assert assert_openai_error(status, body, 404, "model")["code"] == "model_not_found"
    status, body, _ = await post(loadtest_server.base, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert_openai_error(status, body, 404, "model")


async def test_body_over_limit_is_413(loadtest_server):
    big = chat(messages=[{"role": "user", "content": "a" * (5 * 1024 * 1024)}])
    status, body, _ = await post(loadtest_server.base, CHAT, big)
    assert_openai_error(status, body, 413)


async def test_wrong_content_type_is_415(loadtest_server):
    status, body, _ = await post(loadtest_server.base, CHAT, chat(), headers={"Content-Type": "multipart/form-data"})
    assert_openai_error(status, body, 415)


async def test_context_overflow_says_by_how_much(loadtest_server):
    long_prompt = "word " * 9000  # ~9k tokens against the CPU profile's 8192-token context
    status, body, _ = await post(loadtest_server.base, CHAT, chat(messages=[{"role": "user", "content": long_prompt}]))
    err = assert_openai_error(status, body, 400)
    assert err["code"] == "context_length_exceeded" and "too many" in err["message"]
    status, body, _ = await post(loadtest_server.base, "/v1/completions",
                                 {"model": MODEL, "prompt": "hello", "max_tokens": 10_000})
    err = assert_openai_error(status, body, 400, "max_tokens")
    assert "over" in err["message"]


async def test_unknown_route_and_method(loadtest_server):
    async with aiohttp.ClientSession() as s:
        async with s.get(loadtest_server.base + "/v1/nothing") as r:
            assert_openai_error(r.status, await r.read(), 404)
        async with s.get(loadtest_server.base + CHAT) as r:
            assert_openai_error(r.status, await r.read(), 405)


async def test_non_stream_chat_has_usage_and_worker_header(loadtest_server):
    status, body, headers = await post(loadtest_server.base, CHAT, chat(max_tokens=5))
    assert status == 200, body
    data = json.loads(body)
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 5
    assert data["usage"]["prompt_tokens"] > 0
    assert headers["x-pulse-worker"].startswith("pulse-worker-")


async def read_sse(resp) -> list:
    events = []
    async for line in resp.content:
        line = line.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[6:]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


async def test_stream_format_and_usage(loadtest_server):
    async with aiohttp.ClientSession() as s:
        async with s.post(loadtest_server.base + CHAT,
                          json=chat(max_tokens=6, stream=True, stream_options={"include_usage": True})) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await read_sse(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "".join(f" t{i}" for i in range(6))


async def test_completions_stream_without_usage(loadtest_server):
    async with aiohttp.ClientSession() as s:
        async with s.post(loadtest_server.base + "/v1/completions",
                          json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}) as r:
            events = await read_sse(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[0]["object"] == "text_completion"


async def worker_running(base: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/pulse/workers") as r:
            rows = (await r.json())["workers"]
    return sum(w["stats"]["running"] for w in rows)


async def test_client_disconnect_cancels_generation(loadtest_server):
    base = loadtest_server.base
    async with aiohttp.ClientSession() as s:
        resp = await s.post(base + CHAT, json=chat(max_tokens=5000, stream=True,
                                                   messages=[{"role": "user", "content": "go"}]))
        assert resp.status == 200
        await resp.content.readline()

        async def running() -> bool:  # stats are polled every 0.5 s; a loaded box may be later
            return await worker_running(base) >= 1

        await until(running, what="the worker's stats to show the stream running")
        resp.close()  # the client leaves mid-stream
    await until(lambda: worker_running(base), 0, what="the worker to stop the generation of the client that left")


async def test_models_health_metrics(loadtest_server):
    async with aiohttp.ClientSession() as s:
        async with s.get(loadtest_server.base + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == MODEL
        async with s.get(loadtest_server.base + f"/v1/models/{MODEL}") as r:
            assert r.status == 200
        async with s.get(loadtest_server.base + "/health") as r:
            assert r.status == 200
        async with s.get(loadtest_server.base + "/metrics") as r:
            assert r.status == 200 and b"# HELP" in await r.read()
