"""EngineBackend end to end on the real model (NumPy path): streaming chunks, usage with cached tokens,
stop strings, logprobs, cancellation freeing KV blocks, block events for the prefix index, bad input."""
import asyncio

import pytest
import pytest_asyncio

from cache.hashing import chain_hashes
from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from policy.types import load_fields
from tests.integration.engine_helpers import PROMPTS, encode
from workers.cupy.backend import EngineBackend
from workers.protocol import BackendError, GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
GREEDY = SamplingParams(temperature=0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["off", "on"], ids=["in-process", "engine-process"])
async def backend(request):
    """The engine's step thread in the worker's process, and in an engine process of its own
    (workers/cupy/engine_process.py, the default on a GPU): every test here runs against both."""
    events = []
    config = PulseConfig.model_validate({"workers": {"engine": {"kv_blocks": 128, "max_num_seqs": 4,
                                                                "process": request.param}}})
    profile = builtin_profiles()["cpu"].model_copy(update={"worker_queue": 6})  # said in stats, nothing else
    b = EngineBackend(config, profile, load_model_info(None), block_sink=events.append)
    b.events = events
    await b.start()
    assert b.in_engine_process == (request.param == "on")
    yield b
    await b.close()
    await b.close()  # twice is safe


async def collect(backend, request):
    return [c async for c in backend.generate(request)]


async def wait_idle(backend, timeout_s=10.0):
    for _ in range(int(timeout_s / 0.05)):
        s = backend.stats()
        if s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"backend not idle: {backend.stats()}")


async def test_streams_text_then_one_final_chunk_with_usage(backend):
    ids = encode(PROMPTS[0])
    chunks = await collect(backend, GenerateRequest(request_id="a", prompt_ids=ids, max_tokens=12,
                                                    sampling=GREEDY, ignore_eos=True))
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    final = chunks[-1]
    assert final.finish_reason == "length"
    assert final.usage.prompt_tokens == len(ids) and final.usage.completion_tokens == 12
    assert sum(len(c.token_ids) for c in chunks) == 12
    text = "".join(c.text for c in chunks)
    assert text.startswith(" the capital of the country of France")  # greedy, as transformers gives it
    await wait_idle(backend)


async def test_second_request_with_the_same_prefix_reports_cached_tokens(backend):
    ids = encode(" ".join(PROMPTS))
    req = dict(prompt_ids=ids, max_tokens=6, sampling=GREEDY, ignore_eos=True)
    cold = await collect(backend, GenerateRequest(request_id="p1", **req))
    warm = await collect(backend, GenerateRequest(request_id="p2", **req))
    assert warm[-1].usage.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert "".join(c.text for c in warm) == "".join(c.text for c in cold)
    added = {h for e in backend.events if e.kind == "added" for h in e.hashes}
    assert set(chain_hashes(ids, 16, load_model_info(None).chain_root.hash)) <= added  # from the model's root


async def test_cached_blocks_are_what_the_block_events_announced(backend):
    """The prefix index's snapshot (workers/actor.py, with Redis) starts from cached_blocks(): an empty answer
    would wipe the worker's entries there."""
    ids = encode(PROMPTS[3] + " " + PROMPTS[1])
    await collect(backend, GenerateRequest(request_id="cb", prompt_ids=ids, max_tokens=4, sampling=GREEDY))
    await wait_idle(backend)
    held = await backend.cached_blocks()
    assert set(held) == {"gpu"}
    announced = set()
    for e in backend.events:
        announced = announced | set(e.hashes) if e.kind == "added" else announced - set(e.hashes)
    assert set(held["gpu"]) == announced
    assert set(chain_hashes(ids, 16, load_model_info(None).chain_root.hash)) <= set(held["gpu"])


async def test_stop_strings_cut_the_text_and_finish_with_stop(backend):
    ids = encode(PROMPTS[2])
    base = dict(prompt_ids=ids, max_tokens=24, sampling=GREEDY, ignore_eos=True)
    full = "".join(c.text for c in await collect(backend, GenerateRequest(request_id="s0", **base)))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = await collect(backend, GenerateRequest(request_id="s1", stop=[stop], **base))
    assert cut[-1].finish_reason == "stop"
    assert "".join(c.text for c in cut) == full[: full.index(stop)]
    await wait_idle(backend)


async def test_logprobs_come_with_each_token_when_asked(backend):
    chunks = await collect(backend, GenerateRequest(request_id="lp", prompt_ids=encode(PROMPTS[0]), max_tokens=4,
                                                    sampling=GREEDY, ignore_eos=True, logprobs=2))
    lps = [lp for c in chunks for lp in (c.logprobs or [])]
    ids = [t for c in chunks for t in c.token_ids]
    assert [lp.token_id for lp in lps] == ids
    for lp in lps:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id and lp.logprob <= 0


async def test_closing_the_stream_early_frees_the_slot_and_blocks(backend):
    stream = backend.generate(GenerateRequest(request_id="early", prompt_ids=encode(PROMPTS[3]), max_tokens=200,
                                              ignore_eos=True))
    await stream.__anext__()
    assert backend.stats().running == 1
    await stream.aclose()
    await wait_idle(backend)


async def test_cancel_ends_the_stream_with_cancelled(backend):
    req = GenerateRequest(request_id="cx", prompt_ids=encode(PROMPTS[1]), max_tokens=200, ignore_eos=True)
    chunks = []
    async for c in backend.generate(req):
        chunks.append(c)
        if len(chunks) == 1:
            await backend.cancel("cx")
            await backend.cancel("no-such-request")  # ignored
    assert chunks[-1].finish_reason == "cancelled" and chunks[-1].usage.completion_tokens < 200
    await wait_idle(backend)


async def test_concurrent_requests_share_the_batch(backend):
    reqs = [GenerateRequest(request_id=f"c{i}", prompt_ids=encode(p), max_tokens=8, sampling=GREEDY,
                            ignore_eos=True) for i, p in enumerate(PROMPTS[:4])]
    together = await asyncio.gather(*(collect(backend, r) for r in reqs))
    alone = [await collect(backend, GenerateRequest(request_id=f"a{i}", prompt_ids=r.prompt_ids, max_tokens=8,
                                                    sampling=GREEDY, ignore_eos=True)) for i, r in enumerate(reqs)]
    assert ["".join(c.text for c in t) for t in together] == ["".join(c.text for c in a) for a in alone]
    assert backend.stats().tokens_per_s > 0


@pytest.mark.parametrize("bad", [
    dict(prompt_ids=[], max_tokens=4),
    dict(prompt_ids=[2, 10**7], max_tokens=4),
    dict(prompt_ids=[2] * 5000, max_tokens=4),  # longer than this backend's 128 blocks x 16 tokens
    dict(prompt_ids=[2, 3], max_tokens=0),
])
async def test_bad_requests_raise_400_before_any_chunk(backend, bad):
    with pytest.raises(BackendError) as err:
        await collect(backend, GenerateRequest(request_id="bad", **bad))
    assert err.value.status == 400
    await wait_idle(backend)


async def test_stats_describe_the_engine(backend):
    s = backend.stats()
    assert s.slots == 4 and s.kv_blocks_total == 128 and s.block_size == 16 and s.healthy
    # the profile's engine queue, as the gateway's admission reads it (policy.admission.worker_queue)
    assert s.queue_max == 6 and load_fields(s)["queue_max"] == 6
    assert await backend.health()
