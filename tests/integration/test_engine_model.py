"""The engine on the real bundled model (NumPy, CPU): batching, prefix reuse, preemption, chunking and
seeded sampling never change what a request generates."""
import numpy as np
import pytest

from cache.hashing import chain_hashes
from tests.integration.engine_helpers import PROMPTS, encode, make_engine, run
from workers.protocol import SamplingParams
from workers.protocol.model import load_model_info

pytestmark = pytest.mark.slow

N_TOKENS = 16


@pytest.fixture(scope="module")
def prompts():
    return [encode(p) for p in PROMPTS[:4]]


@pytest.fixture(scope="module")
def solo(prompts):
    """Each prompt alone on a fresh engine: the reference every other arrangement must reproduce."""
    return [run(make_engine(), [p], N_TOKENS)[0][0] for p in prompts]


def test_batched_generation_equals_one_at_a_time(prompts, solo):
    tokens, finals = run(make_engine(max_num_seqs=4), prompts, N_TOKENS)
    assert tokens == solo
    assert all(len(t) == N_TOKENS and f.finish_reason == "length" for t, f in zip(tokens, finals))


def test_requests_joining_a_running_batch_get_the_same_tokens(prompts, solo):
    engine = make_engine(max_num_seqs=4)
    from workers.protocol import GenerateRequest

    got = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_work():
        if pending:  # one new request every step, while the earlier ones are decoding
            i, ids = pending.pop(0)
            engine.add(GenerateRequest(request_id=f"j{i}", prompt_ids=ids, max_tokens=N_TOKENS,
                                       sampling=SamplingParams(temperature=0.0), ignore_eos=True))
        for out in engine.step():
            got[int(out.request_id[1:])] += out.token_ids
    assert [got[i] for i in range(len(prompts))] == solo


def test_chunked_prefill_gives_the_same_tokens(prompts, solo):
    tokens, _ = run(make_engine(max_step_tokens=8), prompts, N_TOKENS)
    assert tokens == solo


def test_prefix_cache_hit_reports_cached_tokens_and_changes_nothing():
    events = []
    engine = make_engine(block_sink=events.append)
    prompt = encode(" ".join(PROMPTS))  # several full blocks
    (cold,), (cold_out,) = run(engine, [prompt], 8, tag="cold")
    assert cold_out.cached_tokens == 0
    added = [h for e in events if e.kind == "added" for h in e.hashes]
    root = engine.blocks.root.hash  # the model's chain root: the router hashes from it too
    assert root == load_model_info(None).chain_root.hash != 0
    assert added[: len(prompt) // 16] == chain_hashes(prompt, 16, root)  # the router's hashes, for the index
    (warm,), (warm_out,) = run(engine, [prompt], 8, tag="warm")
    assert warm == cold
    assert warm_out.cached_tokens == (len(prompt) - 1) // 16 * 16
    fresh, _ = run(make_engine(), [prompt], 8)
    assert fresh[0] == cold


def test_preemption_loses_no_tokens(prompts, solo):
    # 6 blocks of 16 tokens cannot hold these four sequences (6-20 prompt tokens + 16 generated) at once
    engine = make_engine(num_blocks=6, max_num_seqs=4)
    tokens, _ = run(engine, prompts, N_TOKENS)
    assert engine.scheduler.preemptions > 0
    assert tokens == solo
    assert engine.blocks.num_used == 0


def test_seeded_sampling_is_reproducible_alone_or_batched(prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone, _ = run(make_engine(), [prompts[2]], N_TOKENS, sampling=seeded)
    engine = make_engine()
    run(engine, [prompts[0]], 4, sampling=SamplingParams(temperature=1.0), tag="other")  # moves the engine rng
    together, _ = run(engine, [prompts[2], prompts[1]], N_TOKENS, sampling=seeded)
    assert together[0] == alone[0]
    other_seed, _ = run(make_engine(), [prompts[2]], N_TOKENS, sampling=SamplingParams(temperature=1.0, seed=99))
    assert other_seed[0] != alone[0]


def test_cancelling_frees_the_slot_and_blocks(prompts):
    engine = make_engine()
    from workers.protocol import GenerateRequest

    engine.add(GenerateRequest(request_id="c", prompt_ids=prompts[0], max_tokens=100))
    engine.step()
    assert engine.blocks.num_used > 0 and len(engine.scheduler.running) == 1
    out = engine.abort("c")
    assert out.finish_reason == "cancelled"
    assert engine.blocks.num_used == 0 and not engine.has_work()


def test_eos_and_stop_token_ids_end_generation(prompts, solo):
    from workers.protocol import GenerateRequest

    engine = make_engine()
    stop_at = solo[0][5]
    engine.add(GenerateRequest(request_id="s", prompt_ids=prompts[0], max_tokens=N_TOKENS,
                               sampling=SamplingParams(temperature=0.0), stop_token_ids=[stop_at]))
    outs = []
    while engine.has_work():
        outs += engine.step()
    generated = [t for o in outs for t in o.token_ids]
    assert generated == solo[0][: solo[0].index(stop_at) + 1] and outs[-1].finish_reason == "stop"


def test_long_prompt_past_the_sliding_window_matches_chunked(prompts):
    """Local layers see only the last 512 positions: one-shot and chunked prefill must agree past it."""
    long_prompt = encode(" ".join(PROMPTS * 12))[:700]
    assert len(long_prompt) > 600
    whole, _ = run(make_engine(max_step_tokens=1024), [long_prompt], 4)
    chunked, _ = run(make_engine(max_step_tokens=96), [long_prompt], 4)
    assert whole == chunked
    assert np.unique(whole[0]).size >= 1
