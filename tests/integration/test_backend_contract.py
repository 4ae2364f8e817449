"""The Backend contract (workers/protocol: Backend's docstring), run against every real backend.

Add a backend by adding a factory to FACTORIES. The load-test backend is an instrument with no model
(it neither detokenizes nor honours stop strings), so it is not held to this contract.
"""
import asyncio
import time

import pytest
import pytest_asyncio

from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from tests.integration.engine_helpers import PROMPTS, encode
from workers.protocol import Backend, BackendError, BackendStats, GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
GREEDY = SamplingParams(temperature=0.0)


def engine_backend(tmp_path, process: str = "off"):
    from workers.cupy.backend import EngineBackend

    config = PulseConfig.model_validate({"workers": {"engine": {"kv_blocks": 128, "max_num_seqs": 4,
                                                                "process": process}}})
    return EngineBackend(config, builtin_profiles()["cpu"], load_model_info(None), worker_id="contract")


def engine_process_backend(tmp_path):
    """The same engine in an engine process of its own (workers/cupy/engine_process.py; the GPU default)."""
    return engine_backend(tmp_path, "on")


def llama_server_backend(tmp_path):
    from tests.integration.llama_server_helpers import make_backend  # skips when llama-server is not built

    return make_backend(tmp_path)


FACTORIES = {"cupy": engine_backend, "cupy-engine-process": engine_process_backend,
             "llama-server": llama_server_backend}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=sorted(FACTORIES))
async def backend(request, tmp_path_factory):
    b: Backend = FACTORIES[request.param](tmp_path_factory.mktemp(request.param))
    await b.start()
    yield b
    await b.close()


def req(rid: str, prompt: str = PROMPTS[2], **kw) -> GenerateRequest:
    kw.setdefault("max_tokens", 12)
    return GenerateRequest(request_id=rid, prompt_ids=encode(prompt), sampling=GREEDY, ignore_eos=True, **kw)


async def collect(backend, request):
    return [c async for c in backend.generate(request)]


async def wait_idle(backend, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if backend.stats().running == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"a slot is still taken: {backend.stats()}")


async def test_started_backend_is_healthy_and_reports_stats(backend):
    assert await backend.health()
    t0 = time.perf_counter()
    stats = backend.stats()
    assert isinstance(stats, BackendStats) and stats.slots >= 1 and stats.healthy
    assert time.perf_counter() - t0 < 0.05  # cheap, never blocks


async def test_text_deltas_then_exactly_one_final_chunk(backend):
    chunks = await collect(backend, req("c1"))
    finals = [i for i, c in enumerate(chunks) if c.finish_reason is not None]
    assert finals == [len(chunks) - 1]
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None
    assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens == len(encode(PROMPTS[2]))
    assert "".join(c.text for c in chunks).strip()


async def test_greedy_output_repeats(backend):
    a = "".join(c.text for c in await collect(backend, req("g1")))
    b = "".join(c.text for c in await collect(backend, req("g2")))
    assert a == b


async def test_frequency_and_presence_penalties_steer_away_from_repeats(backend):
    # unpenalized greedy repeats "the cat"; a frequency penalty (each backend by its own definition: Pulse's
    # engine counts the output, llama-server the last 64 tokens of prompt and output) must stop that
    prompt, n = "the cat the cat the cat the cat the cat the cat the cat the cat", 16
    plain = [t for c in await collect(backend, req("p0", prompt, max_tokens=n)) for t in c.token_ids]
    penalized = GenerateRequest(request_id="p1", prompt_ids=encode(prompt), max_tokens=n, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0))
    tokens = [t for c in await collect(backend, penalized) for t in c.token_ids]
    assert len(tokens) == n and tokens != plain
    assert max(map(tokens.count, tokens)) < max(map(plain.count, plain)), (plain, tokens)


async def test_stop_strings_are_honoured_and_not_returned(backend):
    full = "".join(c.text for c in await collect(backend, req("s0", max_tokens=24)))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    chunks = await collect(backend, req("s1", max_tokens=24, stop=[stop]))
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == full[: full.index(stop)]


async def test_closing_the_iterator_early_frees_the_slot(backend):
    stream = backend.generate(req("early", max_tokens=500))
    await stream.__anext__()
    await stream.aclose()
    await wait_idle(backend)


async def test_cancel_from_outside_ends_the_stream_and_unknown_ids_are_ignored(backend):
    await backend.cancel("never-seen")
    chunks = []

    async def consume():
        async for c in backend.generate(req("cx", max_tokens=500)):
            chunks.append(c)
            if len(chunks) == 1:
                await backend.cancel("cx")

    await asyncio.wait_for(consume(), 60)
    assert sum(len(c.token_ids) for c in chunks) < 500
    await wait_idle(backend)


async def test_an_empty_prompt_is_refused_before_any_output(backend):
    with pytest.raises(BackendError) as err:
        await collect(backend, GenerateRequest(request_id="empty", prompt_ids=[], max_tokens=4))
    assert 400 <= err.value.status < 500


async def test_close_is_safe_twice(tmp_path):
    b = engine_backend(tmp_path)
    await b.close()  # before start
    await b.start()
    await b.close()
    await b.close()
    assert not await b.health()
