"""Request migration: a worker killed mid-stream hands its streams to another worker, which continues them.

- The engine continues a generation from `resume_ids` with the tokens an undisturbed run gives, greedy and
  seeded (the sampler's draw is keyed by the token's index, which counts the resumed tokens), and counts
  usage as one generation.
- A real `pulse serve` (real Ray, the CPU engine, the bundled model) with two workers: one is SIGKILLed
  while a greedy stream is in flight; the official openai client sees one complete stream whose text and
  usage equal an undisturbed run's, and the gateway counts the hand-over in pulse_stream_migrations.
- The same with one worker whose engine runs in a process of its own (as on a GPU box): the engine process is
  SIGKILLed mid-stream, the worker starts another, and the stream goes back to that worker: the same text.
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


async def _both_serving(base: str) -> bool:
    from bench.faults import listening_pids, port_of

    async with aiohttp.ClientSession() as s:
        rows = await workers(s, base)
    return len(rows) == 2 and all(w["routable"] and listening_pids(port_of(w["url"])) for w in rows)


def _wait_both_serving(base: str, timeout_s: float = 120) -> None:
    """A previous test killed a worker: wait until Ray has restarted it and the gateway routes to it."""
    deadline = time.monotonic() + timeout_s
    while not asyncio.run(_both_serving(base)):
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.5)


def _kill(base: str, worker: str, killed: dict) -> None:
    killed["pid"] = asyncio.run(_pid_of(base, worker))
    os.kill(killed["pid"], signal.SIGKILL)
    killed["worker"] = worker


def _one_stream_despite(base: str, kill) -> dict:
    """An undisturbed greedy stream, then the same request with `kill(worker, killed)` called at its 8th chunk:
    the second gets the first's text, finish reason and usage, after one hand-over. Returns what `kill` noted."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=180, max_retries=0)
    expected, finish, whole_usage, _ = _stream(client)
    assert finish == "length" and whole_usage.completion_tokens == MAX_TOKENS and expected

    killed: dict = {}

    def kill_at_chunk(n: int, worker: str) -> None:
        if n == 8 and not killed:
            kill(worker, killed)

    before = _migrations(base)
    text, finish, usage, worker = _stream(client, kill_at_chunk)
    assert killed.get("worker") == worker, f"the stream ended before the kill: {killed}"
    assert text == expected
    assert finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, MAX_TOKENS)
    assert _migrations(base) == before + 1
    return killed


def test_killed_worker_mid_stream_gives_one_complete_stream(two_engines):
    base = two_engines.base
    _wait_both_serving(base)
    _one_stream_despite(base, lambda worker, killed: _kill(base, worker, killed))


def test_anthropic_stream_survives_a_killed_worker(two_engines):
    """The Messages API runs the same relay: its stream moves too, and its events stay in order."""
    import anthropic

    base = two_engines.base
    _wait_both_serving(base)
    client = anthropic.Anthropic(base_url=base, api_key="none", timeout=120, max_retries=0)
    ask = dict(model="gemma-3-270m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
               messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}])

    def run(kill: bool):
        killed: dict = {}
        with client.messages.stream(**ask) as s:
            worker = s.response.headers["x-pulse-worker"]
            kinds = []
            for event in s:
                kinds.append(event.type)
                if kill and len(kinds) == 10 and not killed:
                    _kill(base, worker, killed)
            return s.get_final_text(), s.get_final_message(), kinds, killed

    expected, whole, _, _ = run(False)
    assert whole.stop_reason == "max_tokens", "the undisturbed answer must outlast the kill point"
    _wait_both_serving(base)
    before = _migrations(base)
    text, final, kinds, killed = run(True)
    assert killed, "the stream ended before its worker could be killed"
    assert text == expected and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == MAX_TOKENS
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and "error" not in kinds
    assert _migrations(base) == before + 1


async def _stop_straddling_the_hand_over():
    from policy.config import PulseConfig
    from policy.profiles import builtin_profiles
    from workers.cupy.backend import EngineBackend
    from workers.protocol import GenerateRequest
    from workers.protocol.model import load_model_info

    config = PulseConfig.model_validate({"workers": {"engine": {"kv_blocks": 128, "max_num_seqs": 4}}})
    backend = EngineBackend(config, builtin_profiles()["cpu"], load_model_info(None))
    await backend.start()
    try:
        prompt = encode(PROMPTS[2])

        def request(rid: str, **kw) -> GenerateRequest:
            return GenerateRequest(request_id=rid, prompt_ids=prompt, max_tokens=32, sampling=GREEDY,
                                   ignore_eos=True, **kw)

        whole = [c async for c in backend.generate(request("whole"))]
        full = "".join(c.text for c in whole)
        # a cut after a one-token chunk of 3+ characters; the stop string starts at its last 2 characters
        done, k, stop = "", 0, None
        for c in whole[:-1]:
            done += c.text
            k += len(c.token_ids)
            if k >= 6 and len(c.token_ids) == 1 and len(c.text) >= 3:
                candidate = done[-2:] + full[len(done):len(done) + 4]
                if len(candidate) == 6 and full.find(candidate) == len(done) - 2:
                    stop = candidate
                    break
        assert stop is not None, f"no cut found in {full!r}"
        expected = full[: len(done) - 2]

        # the first worker: stop string set; it dies once its k-th token has been relayed
        first = backend.generate(request("first", stop=[stop]))
        sent, ids = "", []
        async for c in first:
            sent, ids = sent + c.text, ids + c.token_ids
            if len(ids) >= k:
                break
        await first.aclose()
        assert len(ids) == k and sent == expected, (ids, sent)  # the stop string's start is held back
        rest = [c async for c in backend.generate(request("second", stop=[stop], resume_ids=ids))]
        return sent, "".join(c.text for c in rest), rest[-1], expected
    finally:
        await backend.close()


def test_a_stop_string_straddling_the_hand_over_still_matches():
    sent, after, final, expected = asyncio.run(_stop_straddling_the_hand_over())
    assert sent + after == expected
    assert final.finish_reason == "stop"


async def _llama_server_resume(tmp):
    from tests.integration import llama_server_helpers as ls
    from workers.protocol import BackendError

    backend = ls.make_backend(tmp)
    await backend.start()
    try:
        prompt = ls.encode("The three primary colours are red, yellow and blue. Explain how to mix green paint, "
                           "step by step:")  # no near-tie in its first tokens (test_llama_server_backend)
        whole = await ls.collect(backend, ls.request("whole", prompt, max_tokens=24))
        ids = [t for c in whole for t in c.token_ids]
        rest = await ls.collect(backend, ls.request("rest", prompt, max_tokens=24, resume_ids=ids[:9]))
        try:
            await ls.collect(backend, ls.request("json", prompt, max_tokens=24, resume_ids=ids[:9], grammar="{}"))
            refused = None
        except BackendError as e:
            refused = e
        return prompt, ids, rest, refused
    finally:
        await backend.close()


def test_llama_server_continues_a_greedy_generation(tmp_path):
    prompt, ids, rest, refused = asyncio.run(_llama_server_resume(tmp_path))
    assert [t for c in rest for t in c.token_ids] == ids[9:]
    assert (rest[-1].usage.prompt_tokens, rest[-1].usage.completion_tokens) == (len(prompt), 24)
    # a grammar cannot start mid-way on llama-server: refused before any output (the gateway's stream then
    # ends with its one error event)
    assert refused is not None and refused.status == 400 and refused.code == "cannot_resume"


ONE_CONFIG = """
model: {name: gemma-3-270m}
workers:
  backend: cupy
  count: 1
  engine: {device: cpu, kv_blocks: 256, max_num_seqs: 4, process: "on"}
server:
  drain_grace_s: 2
  migration_wait_s: 60  # the hand-over's wait for the restarted engine: generous on a loaded CI box
"""


@pytest.fixture(scope="module")
def one_engine_process(tmp_path_factory):
    srv = PulseProcess([], ONE_CONFIG, tmp_path_factory.mktemp("pulse-one-engine")).wait_ready(300)
    yield srv
    srv.stop()


def _engine_pid(base: str, worker: str) -> int:
    """The worker's engine process (`workers.engine.process: on`): its one descendant running the engine."""
    from bench.procs import descendants

    pids = []
    for child in descendants(asyncio.run(_pid_of(base, worker))):
        try:
            if b"workers.cupy.engine_process" in open(f"/proc/{child}/cmdline", "rb").read():
                pids.append(child)
        except OSError:
            continue
    assert len(pids) == 1, pids
    return pids[0]


def test_the_only_workers_engine_killed_mid_stream_gives_one_complete_stream(one_engine_process):
    """One worker (the single-box default), its engine in a process of its own, as on a GPU box: the engine
    process is SIGKILLed mid-stream; the worker fails its streams and starts another engine process, and the
    gateway hands the stream back to the same worker once it is healthy again (gateway/migration.py). The client
    sees one stream with the undisturbed run's text and usage."""
    base = one_engine_process.base

    def kill_engine(worker: str, killed: dict) -> None:
        killed["pid"], killed["worker"] = _engine_pid(base, worker), worker
        os.kill(killed["pid"], signal.SIGKILL)

    killed = _one_stream_despite(base, kill_engine)
    assert _engine_pid(base, killed["worker"]) != killed["pid"]
