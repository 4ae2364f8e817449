"""What the backend adds in front of llama-server: first-token time through LlamaServerBackend versus a
plain aiohttp client on the same process, same request, interleaved; and the crash-to-serving time.

    python -m workers.llama_server.measure --repeats 20

Prints median [min, max] in ms, after discarding warm-up runs. One process, one client at a time.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from workers.llama_server import api
from workers.llama_server.backend import LlamaServerBackend
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info, load_tokenizer


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.2f} [{min(xs):.2f}, {max(xs):.2f}]"


async def _direct_ttft(session: aiohttp.ClientSession, url: str, req: GenerateRequest) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/completion", data=api.request_body(req, 0),
                            headers={"Content-Type": "application/json"}) as r:
        while True:
            line = await r.content.readuntil(b"\n")
            if line.startswith(b"data: "):
                ttft = time.perf_counter() - t0
                break
        await r.read()
    return ttft * 1000


async def _backend_ttft(backend: LlamaServerBackend, req: GenerateRequest) -> float:
    t0 = time.perf_counter()
    ttft = None
    async for _ in backend.generate(req):
        if ttft is None:
            ttft = time.perf_counter() - t0
    return ttft * 1000


async def main(repeats: int, warmup: int, max_tokens: int) -> None:
    cfg = PulseConfig.model_validate({"workers": {"backend": "llama-server", "llama_server": {
        "slots": 1, "kv_tokens": 4096, "log_dir": tempfile.mkdtemp()}}})
    backend = LlamaServerBackend(cfg, builtin_profiles()["cpu"], load_model_info(), worker_id="measure")
    t0 = time.perf_counter()
    await backend.start()
    print(f"start to healthy: {(time.perf_counter() - t0) * 1000:.0f} ms")
    tok = load_tokenizer()
    prompt = [load_model_info().bos_token_id] + tok.encode("Summarise the plot of Hamlet in one paragraph. " * 4, add_special_tokens=False).ids
    req = GenerateRequest(request_id="m", prompt_ids=prompt, max_tokens=max_tokens,
                          sampling=SamplingParams(temperature=0.0))
    direct, through = [], []
    try:
        async with aiohttp.ClientSession() as session:
            url = backend.lanes[0].process.url
            for i in range(warmup + repeats):  # interleaved, the same cached prompt on the same slot
                d = await _direct_ttft(session, url, req)
                b = await _backend_ttft(backend, req)
                if i >= warmup:
                    direct.append(d)
                    through.append(b)
        print(f"prompt {len(prompt)} tokens (cached after the first run), {max_tokens} generated, {repeats} runs")
        print(f"first token, direct aiohttp client : {_fmt(direct)} ms")
        print(f"first token, LlamaServerBackend    : {_fmt(through)} ms")
        print(f"added (paired differences)         : {_fmt([b - d for b, d in zip(through, direct)])} ms")
        restarts = []
        for _ in range(3):
            pid, before = backend.pids()[0], backend.stats().restarts
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while not (backend.stats().restarts > before and backend.stats().healthy):
                await asyncio.sleep(0.01)
            restarts.append((time.perf_counter() - t0) * 1000)
        print(f"SIGKILL to healthy again (3 runs)  : {_fmt(restarts)} ms")
        print(f"log: {Path(cfg.workers.llama_server.log_dir)}")
    finally:
        await backend.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    a = p.parse_args()
    asyncio.run(main(a.repeats, a.warmup, a.max_tokens))
