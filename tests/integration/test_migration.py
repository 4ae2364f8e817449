"""Request migration: a worker killed mid-stream hands its streams to another worker, which continues them.

- The engine continues a generation from `resume_ids` with the tokens an undisturbed run gives, greedy and
  seeded (the sampler's draw is keyed by the token's index, which counts the resumed tokens), and counts
  usage as one generation.
- A real `pulse serve` (real Ray, the CPU engine, the bundled model) with two workers: one is SIGKILLed
  while a greedy stream is in flight; the official openai client sees one complete stream whose text and
  usage equal an undisturbed run's, and the gateway counts the hand-over in pulse_stream_migrations.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import aiohttp
import openai
import pytest

from bench.faults import worker_pid, workers
from tests.conftest import PulseProcess
from tests.integration.engine_helpers import GREEDY, PROMPTS, encode, make_engine, run
from workers.protocol import SamplingParams

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_engine_resumes_a_generation_where_it_stopped(sampling):
    prompt = encode(PROMPTS[2])
    (whole,), (final,) = run(make_engine(), [prompt], 24, sampling, tag="whole")
    (rest,), (resumed,) = run(make_engine(), [prompt], 24, sampling, tag="resumed", resume_ids=whole[:9])
    assert rest == whole[9:]
    assert (resumed.prompt_tokens, resumed.completion_tokens) == (len(prompt), 24) == (final.prompt_tokens, 24)
    assert resumed.finish_reason == "length"


CONFIG = """
model: {name: gemma-3-270m}  # one model (a config naming none serves both bundled ones)
workers:
  backend: cupy
  count: 2
  engine: {device: cpu, kv_blocks: 256, max_num_seqs: 4}
server:
  drain_grace_s: 2
"""
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    srv = PulseProcess([], CONFIG, tmp_path_factory.mktemp("pulse-migration")).wait_ready(300)
    yield srv
    srv.stop()


def _stream(client: openai.OpenAI, on_chunk=None) -> tuple[str, str, object, str]:
    """One greedy chat stream through the openai SDK: (text, finish reason, usage, worker header)."""
    raw = client.chat.completions.with_raw_response.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    text, finish, usage, n = "", None, None, 0
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        n += 1
        if on_chunk is not None:
            on_chunk(n, raw.headers["x-pulse-worker"])
    return text, finish, usage, raw.headers["x-pulse-worker"]


def _migrations(base: str) -> float:
    body = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith('pulse_stream_migrations_total{outcome="resumed"}'))


async def _pid_of(base: str, worker_id: str) -> int:
    async with aiohttp.ClientSession() as s:
        return worker_pid(await workers(s, base), worker_id)


def test_killed_worker_mid_stream_gives_one_complete_stream(two_engines):
    base = two_engines.base
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    expected, finish, whole_usage, _ = _stream(client)
    assert finish == "length" and whole_usage.completion_tokens == MAX_TOKENS and expected

    killed: dict = {}

    def kill_at_chunk(n: int, worker: str) -> None:
        if n == 8 and not killed:
            killed["pid"] = asyncio.run(_pid_of(base, worker))
            os.kill(killed["pid"], signal.SIGKILL)
            killed["at_chunk"], killed["worker"], killed["t"] = n, worker, time.monotonic()

    before = _migrations(base)
    text, finish, usage, worker = _stream(client, kill_at_chunk)
    assert killed.get("worker") == worker, f"the stream ended before its worker could be killed: {killed}"
    assert text == expected
    assert finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, MAX_TOKENS)
    assert _migrations(base) == before + 1
