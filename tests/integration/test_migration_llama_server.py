"""Request migration with llama-server workers: a real `pulse serve --backend llama-server` (real Ray, two
workers, each with the real binary and the bundled GGUF), spans exported to a real OTLP receiver.

- The llama-server child process of a stream's worker is SIGKILLed mid-stream: the worker survives and
  streams the in-band error chunk; the gateway moves the stream to the other worker, and the client sees
  one complete stream with the undisturbed run's text, finish reason and usage.
- The worker actor itself is SIGKILLed mid-stream (its llama-server dies with it): the same.
- Each hand-over is an event on the request's span naming the failed and the continuing worker; the
  `x-pulse-worker` header names the first.

One stream at a time: llama.cpp's greedy output depends on the batch a sequence ran in (RELIABILITY.md,
"Request migration"), so text equality is checked where the continuation runs alone, on a prompt with
no near-tie in its first tokens (test_migration.py's llama-server resume). Skips where llama-server is not
built (deploy/build_llama_server.sh).
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

from bench import request_timeline
from bench.faults import both_serving, child_pids, worker_pid, workers
from tests.conftest import PulseProcess
from tests.integration.llama_server_helpers import serve_config
from tests.otlp_sink import OtlpSink

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are red, yellow and blue. Explain how to mix green paint, step by step:"
MAX_TOKENS = 24
KILL_AT = 8  # the stream's chunk at which its worker (or its llama-server) is killed


@pytest.fixture(scope="module")
def two_llama_workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pulse-llama-migration")
    config = serve_config(tmp, count=2, slots=2, kv_tokens=2048, threads=1,  # skips when llama-server is not built
                          more="server:\n  drain_grace_s: 2\n")
    with OtlpSink() as sink:
        srv = PulseProcess([], config, tmp, env=sink.env("http/protobuf")).wait_ready(300)
        try:
            yield srv, sink
        finally:
            srv.stop()


def _wait_both_serving(base: str, timeout_s: float = 120) -> None:
    """Both workers routable, each with its llama-server running (a previous test killed one)."""
    async def check() -> bool:
        async with aiohttp.ClientSession() as s:
            return await both_serving(s, base, "llama-server")

    deadline = time.monotonic() + timeout_s
    while not asyncio.run(check()):
        assert time.monotonic() < deadline, "the killed worker or llama-server did not come back"
        time.sleep(0.5)


def _worker_pid(base: str, worker_id: str) -> int:
    async def pid() -> int:
        async with aiohttp.ClientSession() as s:
            return worker_pid(await workers(s, base), worker_id)

    return asyncio.run(pid())


def _migrations(base: str) -> float:
    body = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith('pulse_stream_migrations_total{outcome="resumed"}'))


def _stream(client: openai.OpenAI, trace_id: str, on_chunk=None) -> tuple[str, str, object, str]:
    """One greedy completion stream through the openai SDK: (text, finish reason, usage, worker header)."""
    raw = client.completions.with_raw_response.create(
        model="gemma-3-270m", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    worker = raw.headers["x-pulse-worker"]
    text, finish, usage = "", None, None
    for n, chunk in enumerate(raw.parse(), 1):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text or ""
            finish = choice.finish_reason or finish
        if on_chunk is not None:
            on_chunk(n, worker)
    return text, finish, usage, worker


def test_a_served_requests_spans_split_its_time_to_first_token(two_llama_workers):
    """One trace from the gateway through the worker to llama-server: the backend's `pulse.llama_server` span is
    under the worker's, with its slot and llama-server's timings, and bench.request_timeline splits the request's
    TTFT into parts that add up to it (the parity bench's --trace)."""
    srv, sink = two_llama_workers
    _wait_both_serving(srv.base)
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=120, max_retries=0)
    trace_id = os.urandom(16).hex()
    _stream(client, trace_id)
    spans = sink.wait_for(lambda s: {"POST /v1/completions", "pulse.llama_server"}
                          <= {x.name for x in s if x.trace_id == trace_id}, 20)
    mine = [x for x in spans if x.trace_id == trace_id]
    (llama,) = [x for x in mine if x.name == "pulse.llama_server"]
    (prefill,) = [x for x in mine if x.name == "pulse.prefill"]
    assert llama.parent_span_id == prefill.span_id and llama.service == prefill.service
    assert llama.attributes["pulse.llama_server.slot"] in (0, 1)
    assert llama.attributes["pulse.llama_server.predicted_n"] == MAX_TOKENS
    (row,) = request_timeline.timelines(mine)
    parts = [row[p] for p in request_timeline.PARTS]
    assert row["ttft_ms"] > 0 and min(parts) > -1.0, row  # one box, one clock: no part runs backwards
    assert sum(parts) == pytest.approx(row["ttft_ms"])
    assert row["prompt_ms"] > 0 and row["admissions"] == 1


@pytest.mark.parametrize("target", ["llama-server", "worker"])
def test_a_stream_moves_when_its_llama_server_worker_dies(two_llama_workers, target):
    srv, sink = two_llama_workers
    base = srv.base
    _wait_both_serving(base)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    expected, whole_finish, whole_usage, _ = _stream(client, os.urandom(16).hex())
    assert whole_usage.completion_tokens == MAX_TOKENS and expected

    killed: dict = {}

    def kill_at(n: int, worker: str) -> None:
        if n == KILL_AT and not killed:
            pid = _worker_pid(base, worker)
            killed.update(worker=worker, worker_pid=pid)
            (killed["pid"],) = child_pids(pid, "llama-server") if target == "llama-server" else (pid,)
            os.kill(killed["pid"], signal.SIGKILL)

    before = _migrations(base)
    trace_id = os.urandom(16).hex()
    text, finish, usage, worker = _stream(client, trace_id, kill_at)
    assert killed.get("worker") == worker, f"the stream ended before its worker could be killed: {killed}"
    assert text == expected
    assert finish == whole_finish
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, MAX_TOKENS)
    assert _migrations(base) == before + 1
    if target == "llama-server":  # the worker actor lived on; only its child died
        assert _worker_pid(base, worker) == killed["worker_pid"]

    spans = sink.wait_for(lambda s: any(x.trace_id == trace_id and x.name == "POST /v1/completions" for x in s), 20)
    (http,) = [x for x in spans if x.trace_id == trace_id and x.name == "POST /v1/completions"]
    assert http.events.count("pulse.migrated") == 1
    moved = http.event_attributes[http.events.index("pulse.migrated")]
    assert moved["pulse.worker.failed"] == worker != moved["pulse.worker"]
    assert 0 < moved["pulse.resumed_tokens"] < MAX_TOKENS
