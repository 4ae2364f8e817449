"""The gateway's worker channel (gateway/channel.py) against real worker servers on loopback.

- a real StreamServer (load-test backend): consecutive requests reuse one connection; a stream closed
  mid-way drops its connection and the worker cancels the generation (its slot comes back);
- an aiohttp server that closes idle keep-alive connections quickly: the next request still succeeds;
- nothing listening: a ConnectionRefusedError (what the pool turns into a 503 worker_unreachable).
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from gateway import channel
from gateway.channel import Channels
from policy.config import PulseConfig
from tests.waiting import until
from workers.loadtest import LoadTestBackend
from workers.protocol import GenerateRequest, encode
from workers.stream import StreamServer


def _server(tokens: int, rate: float = 0.0) -> StreamServer:
    config = PulseConfig.model_validate({"workers": {"backend": "loadtest",
                                                     "loadtest": {"tokens": tokens, "tokens_per_s": rate}}})
    return StreamServer(LoadTestBackend(config, worker_id="w0"), worker_id="w0")


def _gen(rid: str, max_tokens: int = 4) -> bytes:
    return encode(GenerateRequest(request_id=rid, prompt_ids=[1, 2, 3], max_tokens=max_tokens))


async def test_requests_reuse_one_connection_and_stream_every_chunk():
    srv = _server(tokens=4)
    url = await srv.start()
    channels = Channels()
    try:
        seen = set()
        for i in range(3):
            s = await channels.open(url, "/generate", _gen(f"r{i}"), srv.secret)
            assert s.status == 200
            chunks = [c async for batch in s.batches() for c in batch]
            assert [c.text for c in chunks[:-1]] == [" t0", " t1", " t2", " t3"]
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 4
            seen.add(id(s))
            s.close()
        assert len(seen) == 1  # one connection, kept alive across the three
        assert channels.idle_count() == 1
    finally:
        await channels.close()
        await srv.close()


async def test_a_wrong_secret_gets_the_workers_401_body():
    srv = _server(tokens=4)
    url = await srv.start()
    channels = Channels()
    try:
        s = await channels.open(url, "/generate", _gen("r"), "wrong")
        assert s.status == 401 and b"unauthorized" in await s.body()
        s.close()
    finally:
        await channels.close()
        await srv.close()


async def test_closing_mid_stream_cancels_the_generation():
    srv = _server(tokens=1000, rate=50.0)
    url = await srv.start()
    channels = Channels()
    try:
        s = await channels.open(url, "/generate", _gen("r", max_tokens=1000), srv.secret)
        it = s.batches()
        assert (await it.__anext__())[0].text == " t0"
        assert srv.backend.running == 1
        s.close()
        for _ in range(100):
            if srv.backend.running == 0:
                break
            await asyncio.sleep(0.02)
        assert srv.backend.running == 0  # the worker saw the connection close and freed the slot
        assert channels.idle_count() == 0
    finally:
        await channels.close()
        await srv.close()


async def test_a_keep_alive_connection_closed_by_the_worker_is_not_a_failure():
    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(b'{"text": "a", "token_ids": [1]}\n{"finish_reason": "stop"}\n')
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, keepalive_timeout=0.05)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    channels = Channels()
    try:
        for _ in range(3):
            s = await channels.open(url, "/generate", b"{}", "x")
            assert [c.text for batch in [b async for b in s.batches()] for c in batch] == ["a", ""]
            s.close()
            assert channels.idle_count() == 1
            await asyncio.sleep(0.2)  # the server closes the idle connection meanwhile
            assert channels.idle_count() == 0  # and the pool lets go of it
    finally:
        await channels.close()
        await runner.cleanup()


async def test_nothing_listening_is_a_connection_error():
    srv = _server(tokens=1)
    url = await srv.start()
    await srv.close()
    channels = Channels()
    try:
        try:
            await channels.open(url, "/generate", _gen("r"), "x")
        except OSError:
            pass
        else:
            raise AssertionError("opened a stream to a closed port")
    finally:
        await channels.close()


async def _late_terminator_server(delay_s: float) -> tuple[web.AppRunner, str]:
    """A worker that writes its final chunk, then the chunked terminator `delay_s` later (a worker's server
    sends it in a write of its own once the handler returns)."""
    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(b'{"text": "a", "token_ids": [1]}\n{"finish_reason": "stop"}\n')
        await asyncio.sleep(delay_s)
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _read_to_final(s) -> list[str]:
    texts = []
    async for batch in s.batches():
        texts += [c.text for c in batch]
        if batch[-1].finish_reason is not None:
            return texts  # as the relay does: it stops at the final chunk
    return texts


async def test_a_stream_closed_at_its_final_chunk_keeps_its_connection_once_the_terminator_comes():
    runner, url = await _late_terminator_server(0.1)
    channels = Channels()
    try:
        first = await channels.open(url, "/generate", b"{}", "x")
        assert await _read_to_final(first) == ["a", ""]
        first.close()  # before the terminator: the connection waits for it
        assert channels.idle_count() == 0 and first.transport is not None
        await until(channels.idle_count, 1, timeout_s=5, what="the connection back in the pool")
        second = await channels.open(url, "/generate", b"{}", "x")
        assert second is first  # the same connection, not a new one
        assert await _read_to_final(second) == ["a", ""]
        second.close()
    finally:
        await channels.close()
        await runner.cleanup()


async def test_a_terminator_that_does_not_come_within_the_linger_drops_the_connection(monkeypatch):
    monkeypatch.setattr(channel, "LINGER_S", 0.05)
    runner, url = await _late_terminator_server(0.5)
    channels = Channels()
    try:
        s = await channels.open(url, "/generate", b"{}", "x")
        assert await _read_to_final(s) == ["a", ""]
        s.close()
        await until(lambda: s.transport is None and channels.idle_count() == 0, timeout_s=5,
                    what="the connection dropped")
    finally:
        await channels.close()
        await runner.cleanup()
