"""Schema compilation never stalls other streams: a real `pulse serve` (load-test backend, 400 tokens/s).

While one stream runs, other clients send a ~1 MB schema (refused for its size: 400 schema_too_large)
and 14 requests at once, each with its own ~58 KB response_format schema (each compiled on the gateway's
schema pool: ~0.1 s of CPU each, which inline on the event loop stalled every stream that long). The stream's largest
gap between two chunks stays under 100 ms (a round of 14 that passes it is run once more, with fresh schemas).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time

import aiohttp

from gateway.structured import MAX_SCHEMA_BYTES

JSON = {"Content-Type": "application/json"}


def _schema(salt: str, fields: int) -> dict:
    return {"type": "object", "properties": {
        f"{salt}_{i}": {"type": "string", "pattern": "[a-z]{3,9}[0-9]+", "description": "x" * 20}
        for i in range(fields)}}


async def _model(http, base) -> str:
    async with http.get(base + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def _stream_gaps(http, base, model, started: asyncio.Event, gaps: list[float]) -> list[float]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2400, "stream": True}
    last = None
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        async for _ in r.content.iter_any():
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            else:
                started.set()
            last = now
    return gaps


async def test_a_huge_schema_is_a_400_and_compiles_do_not_stall_streams(loadtest_server):
    base = loadtest_server.base
    salt = secrets.token_hex(4)  # fresh schemas: no verdict cached from an earlier run

    def fourteen(tag: str) -> list[bytes]:
        return [json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "response_format": {"type": "json_schema", "json_schema": {
                                "name": "s", "schema": _schema(f"{salt}{tag}{i}", 600)}}}).encode()
                for i in range(14)]

    async with aiohttp.ClientSession() as http:
        model = await _model(http, base)
        # bodies encoded before the stream starts: this client's own event loop must not stall either
        attempts = [fourteen("a"), fourteen("b")]
        huge = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                           "response_format": {"type": "json_schema", "json_schema": {
                               "name": "big", "schema": _schema(salt, 11_000)}}}).encode()
        started, gaps = asyncio.Event(), []
        stream = asyncio.create_task(_stream_gaps(http, base, model, started, gaps))
        await started.wait()
        await asyncio.sleep(0.5)  # the stream alone: its gaps on this machine as it is now
        quiet = len(gaps)
        async with http.post(base + "/v1/chat/completions", data=huge, headers=JSON) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["code"] == "schema_too_large", error
            assert str(MAX_SCHEMA_BYTES) in error["message"]
        await asyncio.sleep(0.3)
        around_huge = max(gaps[quiet:])
        phases = [f"largest gap {max(gaps[:quiet]) * 1000:.0f} ms with the stream alone",
                  f"{around_huge * 1000:.0f} ms around the 1 MB schema"]

        async def constrained(body: bytes) -> int:
            async with http.post(base + "/v1/chat/completions", data=body, headers=JSON) as r:
                await r.read()
                return r.status

        # Inline compiles stall the loop every time they run; a 2-core CI box once showed a single 152 ms gap
        # that a second round of 14 fresh schemas did not repeat. So: a round whose largest gap passes 100 ms
        # is run again, and the last round run decides (an inline compile fails both).
        for bodies in attempts:
            first = len(gaps)
            t0 = time.perf_counter()
            assert await asyncio.gather(*(constrained(b) for b in bodies)) == [200] * 14
            compiled_s = time.perf_counter() - t0
            assert not stream.done(), "the stream ended before the compiles did: " + "; ".join(phases)
            round_max = max(gaps[first:])
            phases.append(f"{round_max * 1000:.0f} ms while 14 schemas compiled ({compiled_s:.2f} s)")
            if round_max < 0.1:
                break
        await stream
    assert len(gaps) > 50
    assert around_huge < 0.1 and round_max < 0.1, "; ".join(phases)


async def test_a_schema_that_does_not_compile_is_a_400_naming_its_parameter(loadtest_server):
    base = loadtest_server.base
    async with aiohttp.ClientSession() as http:
        model = await _model(http, base)
        bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}
        tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
                 {"type": "function", "function": {"name": "f", "parameters": bad}}]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": tools}
        for _ in range(2):  # the second answer comes from the verdict cache, the same
            async with http.post(base + "/v1/chat/completions", json=body) as r:
                error = (await r.json())["error"]
                assert r.status == 400 and error["param"] == "tools[1].function.parameters", error
                assert error["code"] == "invalid_schema"
