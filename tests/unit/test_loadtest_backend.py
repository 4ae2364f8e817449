"""The load-test backend's pacing: the first token at once (or after `ttft_s`), the rest at `tokens_per_s`, as the
bench's upstream paces its stream (bench/relay.py), so a held stream's "added TTFT" in bench/gateway_overhead.py
is the gateway's alone."""
from __future__ import annotations

import time

import pytest

from policy.config import PulseConfig
from workers.loadtest import LoadTestBackend
from workers.protocol import GenerateRequest


async def _times(ttft_s: float) -> tuple[float, float, int]:
    config = PulseConfig.model_validate({"workers": {"backend": "loadtest", "loadtest": {
        "tokens": 3, "tokens_per_s": 10, "ttft_s": ttft_s}}})
    backend = LoadTestBackend(config, worker_id="w0")
    t0, first, n = time.perf_counter(), None, 0
    async for chunk in backend.generate(GenerateRequest(request_id="r", prompt_ids=[1, 2], max_tokens=3)):
        if chunk.token_ids:
            first = first if first is not None else time.perf_counter() - t0
            n += len(chunk.token_ids)
    return first, time.perf_counter() - t0, n


@pytest.mark.parametrize("ttft_s", [0.0, 0.3])
async def test_first_token_after_ttft_then_the_rate(ttft_s):
    first, total, n = await _times(ttft_s)
    assert n == 3
    assert ttft_s <= first < ttft_s + 0.08  # not one gap (0.1 s) late
    assert ttft_s + 0.2 <= total < ttft_s + 0.35  # two gaps after the first token


@pytest.mark.parametrize("ttft", [0.0, 0.3])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_the_bench_upstream_paces_only_between_tokens(path, ttft):
    """bench/relay.py's upstream: 3 tokens at 10/s take two gaps (0.2 s), as the load-test backend's do; the finish
    and usage events follow the last token at once (they had waited a gap each: 0.4 s a stream). With `ttft` the
    first token comes that much later (a chat stream's role event still at once), as the backend's `ttft_s`."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from bench.relay import upstream_app

    async with TestServer(upstream_app(tokens=3, rate=10, ttft=ttft), host="127.0.0.1") as server:
        async with aiohttp.ClientSession() as session:
            t0 = time.perf_counter()
            body = {"model": "m", "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True},
                    **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})}
            first = None
            async with session.post(server.make_url(path), json=body) as r:
                raw = b""
                async for line in r.content:
                    raw += line
                    if first is None and b" tok" in line:
                        first = time.perf_counter() - t0
            total = time.perf_counter() - t0
    assert raw.count(b" tok") == 3 and raw.endswith(b"data: [DONE]\n\n")
    assert ttft <= first < ttft + 0.08
    assert ttft + 0.2 <= total < ttft + 0.28


async def test_with_no_rate_the_upstream_and_the_backend_give_the_loop_a_turn_before_each_later_token():
    """At --rate 0 (bench/gateway_overhead.py's default) both test doubles still yield before each token after the
    first, as a server sending a token a step does: the upstream had written its whole stream in one turn while the
    backend yielded, which left Pulse's path alone paying a loop turn a token. A ticker on the same loop counts the
    turns it gets while one 200-token stream is made."""
    import asyncio

    import aiohttp
    from aiohttp.test_utils import TestServer

    from bench.relay import upstream_app

    n = 200
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    config = PulseConfig.model_validate({"workers": {"backend": "loadtest", "loadtest": {"tokens": n}}})
    backend = LoadTestBackend(config, worker_id="w0")
    async with TestServer(upstream_app(tokens=n), host="127.0.0.1") as server:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "stream": True, "max_tokens": n, "prompt": "x"}
            for source in ("upstream", "backend"):
                task = asyncio.create_task(ticker())
                await asyncio.sleep(0)
                ticks, got = 0, 0
                if source == "upstream":
                    async with session.post(server.make_url("/v1/completions"), json=body) as r:
                        got = (await r.read()).count(b" tok")
                else:
                    async for chunk in backend.generate(GenerateRequest(request_id="r", prompt_ids=[1], max_tokens=n)):
                        got += len(chunk.token_ids)
                task.cancel()
                assert got == n, source
                assert ticks >= n - 1, (source, ticks)


async def test_with_a_batch_the_rest_wait_inside_in_arrival_order_and_stats_say_the_places():
    """`batch`: that many streams generate at once and the others wait inside the backend (an engine's scheduler
    queue), first come first served; its stats report `batch` slots, the waiting and `worker_queue`, as an engine's
    do, so the gateway's admission sees the places an engine has. Past `slots` it still refuses (429)."""
    import asyncio

    from workers.protocol import BackendError

    config = PulseConfig.model_validate({"workers": {"backend": "loadtest", "loadtest": {
        "tokens": 2, "tokens_per_s": 20, "batch": 2, "worker_queue": 3, "slots": 4}}})
    backend = LoadTestBackend(config, worker_id="w0")
    firsts: dict[str, float] = {}
    ends: dict[str, float] = {}

    async def run(rid: str) -> None:
        async for chunk in backend.generate(GenerateRequest(request_id=rid, prompt_ids=[1], max_tokens=2)):
            if chunk.token_ids and rid not in firsts:
                firsts[rid] = time.perf_counter()
        ends[rid] = time.perf_counter()

    tasks = [asyncio.create_task(run(f"r{i}")) for i in range(4)]
    await asyncio.sleep(0.02)
    stats = backend.stats()
    assert (stats.running, stats.waiting, stats.slots, stats.queue_max) == (2, 2, 2, 3)
    with pytest.raises(BackendError) as refused:  # 4 accepted: the fifth is past `slots`
        await anext(backend.generate(GenerateRequest(request_id="r4", prompt_ids=[1], max_tokens=2)))
    assert refused.value.status == 429
    await asyncio.gather(*tasks)
    # the waiting two start in arrival order, each once a place was freed (after a stream of the batch ended)
    assert max(firsts["r0"], firsts["r1"]) < firsts["r2"] <= firsts["r3"]
    assert firsts["r2"] >= min(ends["r0"], ends["r1"]) and firsts["r3"] >= sorted([ends["r0"], ends["r1"]])[1]
    assert (backend.stats().running, backend.stats().waiting) == (0, 0)
