"""llama.cpp's CPU build on bench.engine_cpu's three cases, measured in the same run as the engine.

    python -m bench.engine_cpu --repeats 5 --llama-threads 1 2

One llama-server per thread count: the real binary deploy/build_llama_server.sh built, the bundled GGUF
(Q4_K_M), bound to 127.0.0.1 on a free port, started and stopped by workers.llama_server.process with the
argv of workers.llama_server.flags. `-np 8` so the batch-8 case runs its 8 requests in parallel slots of
one server; the batch-1 and prefill cases use one slot of the same server. Requests send the engine's own
prompt token ids, greedy (temperature 0, top_k 1), `ignore_eos`, and `cache_prompt: false`, so every prefill
is real: the final timings must show cache_n 0 and the whole prompt evaluated, or the run stops.

Rates: prefill is llama-server's prompt_per_second; batch-1 decode its predicted_per_second (this build
counts n_gen - 1 tokens over the time after the first one, which comes from the prompt's logits: the
engine's definition too). Batch 8 is timed by the client over the stream, as the engine's b8 case is timed
over its steps: the tokens that arrive after the last of the 8 first tokens, over the time from then to
the last final event; the whole-request aggregate (all tokens over send-to-done wall time, prefill
included) is kept beside it. Per CPU second: the same tokens over the server process' utime + stime
(/proc, 10 ms ticks) in the same span, which a shared box distorts far less than wall time.
"""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.procs import cpu_ticks
from workers.llama_server.binary import find_llama_server
from workers.llama_server.flags import server_argv, supported_flags
from workers.llama_server.process import LlamaServerProcess

SLOTS = 8
KV_TOKENS = 4096  # the 512-token prefill, and 8 x (16 + 32) for batch 8, in one unified pool
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_FIELDS = ["tokens", "stop", "stop_type", "timings"]


def completion_body(prompt: list[int], n_predict: int) -> dict:
    return {"prompt": prompt, "n_predict": n_predict, "stream": True, "cache_prompt": False,
            "temperature": 0.0, "top_k": 1, "ignore_eos": True, "return_tokens": True,
            "response_fields": _FIELDS}


def checked_timings(timings: dict | None, prompt_len: int, n_predict: int) -> dict:
    """The final event's timings, refused unless the whole prompt was prefilled now and every token made."""
    if not timings:
        raise ValueError("llama-server's final event has no timings")
    if timings.get("cache_n", 0) != 0 or timings.get("prompt_n") != prompt_len:
        raise ValueError(f"not a full prefill of {prompt_len} tokens (cache_prompt ignored?): {timings}")
    if timings.get("predicted_n") != n_predict:
        raise ValueError(f"expected {n_predict} generated tokens: {timings}")
    return timings


@dataclass
class Stream:
    """One streamed completion: when each event came (perf_counter) and how many tokens it carried."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)
    timings: dict | None = None


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], n_predict: int,
                 on_first=None) -> Stream:
    out = Stream()
    async with session.post(url + "/completion", json=completion_body(prompt, n_predict)) as r:
        if r.status != 200:
            raise RuntimeError(f"llama-server {r.status}: {(await r.text())[:500]}")
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"llama-server error: {event['error']}")
            n = len(event.get("tokens") or [])
            if n:
                out.arrivals.append((time.perf_counter(), n))
                if on_first is not None and len(out.arrivals) == 1:
                    on_first()
            if event.get("stop"):
                out.timings = checked_timings(event.get("timings"), len(prompt), n_predict)
    return out


class LlamaCpu:
    """One llama-server with `threads` threads and the engine's cases against it."""

    def __init__(self, model_path: Path, threads: int, log_dir: Path | None = None):
        self.threads = threads
        self.name = f"llama.cpp -t {threads}"
        binary = find_llama_server(os.environ.get("PULSE_LLAMA_SERVER") or None)
        flags = supported_flags(binary)
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pulse-llama-cpu-"))
        self.process = LlamaServerProcess(
            lambda port: server_argv(binary, flags, model=str(model_path), port=port, slots=SLOTS,
                                     kv_tokens=KV_TOKENS, profile_args=[], threads=threads),
            name=f"llama-cpu-t{threads}", log_path=log_dir / f"llama-cpu-t{threads}.log")
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        await self.process.start()
        # a fresh connection per request, as the worker's backend does: llama-server closes kept-alive
        # connections between requests, and a reused closed one fails with "Can not write request body"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                              connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self.process.stop()

    def cpu_s(self) -> float:
        """utime + stime of the server process, all its threads (dead ones included), in seconds."""
        ticks = cpu_ticks([self.process.pid])
        if not ticks:
            raise RuntimeError(f"{self.name} is not running:\n{self.process.log_tail()}")
        return next(iter(ticks.values()))[1] * _TICK_S

    async def prefill(self, prompt: list[int]) -> dict:
        """One prompt, one token: prompt tokens/s from the server's timings, and per server CPU second."""
        c0 = self.cpu_s()
        s = await stream(self._session, self.process.url, prompt, 1)
        return {"wall": s.timings["prompt_per_second"], "cpu": len(prompt) / max(self.cpu_s() - c0, _TICK_S)}

    async def decode(self, prompts: list[list[int]], n_tokens: int) -> dict:
        """len(prompts) concurrent streams of n_tokens each; rates over the time after the last first token."""
        firsts, mark = [], {}

        def on_first() -> None:
            firsts.append(1)
            if len(firsts) == len(prompts):  # every prompt is prefilled: from here on it is decode only
                mark["t"], mark["cpu"] = time.perf_counter(), self.cpu_s()

        sent = time.perf_counter()
        streams = await asyncio.gather(*(stream(self._session, self.process.url, p, n_tokens, on_first)
                                         for p in prompts))
        end, cpu_end = max(s.arrivals[-1][0] for s in streams), self.cpu_s()
        rates = decode_rates(streams, mark["t"], end, cpu_end - mark["cpu"])
        if len(prompts) == 1:  # one sequence: the server's own clock, no client in the way
            rates["wall"] = streams[0].timings["predicted_per_second"]
        rates["wall, whole requests"] = sum(s.timings["predicted_n"] for s in streams) / (end - sent)
        return rates


def decode_rates(streams: list[Stream], t0: float, end: float, cpu_s: float) -> dict:
    """Tokens that arrived after t0, per wall second (t0 to end) and per server CPU second."""
    after = sum(n for s in streams for t, n in s.arrivals if t > t0)
    # at least one clock tick: a span shorter than the tick resolution reads as 0 s of CPU
    return {"wall": after / (end - t0), "cpu": after / max(cpu_s, _TICK_S)}
