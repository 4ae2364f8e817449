"""The GPU engine's overlap (workers/cupy/engine.py): each decode step launched before the one before it is read,
its input ids taken from the previous step's in-step draws on the device (GpuSampler.hold), with the graphs' and
draws' pinned staging buffers alternating. On the real GGUF: the same tokens as the same engine stepping one
step at a time, greedy and seeded temperature 1, with finishes by length at different steps, waiting requests
joining steps launched ahead, stop tokens and a cancellation in between."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tests.gpu.test_gemma3_gpu import BS, PROMPTS, real  # noqa: F401  (the module's fixture)
from workers.protocol import GenerateRequest, SamplingParams

pytest.importorskip("cupy")

KW = dict(block_size=BS, num_blocks=1024, max_num_seqs=4, max_step_tokens=1024, context_length=2048)


@pytest.fixture(scope="module")
def engines(real):  # noqa: F811
    from workers.cupy.gpu import create_gpu_engine

    info, weights, tok = real
    off = create_gpu_engine(info, weights, **KW)
    on = create_gpu_engine(info, weights, **KW)
    on.overlap = True
    prompts = [[info.bos_token_id] + tok.encode(t).ids for t in PROMPTS[:4]]
    return off, on, prompts


def drive(engine, reqs, abort_at=None):
    for r in reqs:
        engine.add(r)
    tokens, final, steps = defaultdict(list), {}, 0
    while engine.has_work():
        for out in engine.step():
            assert out.request_id not in final
            tokens[out.request_id] += out.token_ids
            if out.finish_reason:
                final[out.request_id] = out
        steps += 1
        for rid, at in (abort_at or {}).items():
            if at == steps and (out := engine.abort(rid)) is not None:
                final[rid] = out
    return dict(tokens), final


def reqs(prompts, tag, sampling, lengths, **kw):
    return [GenerateRequest(request_id=f"{tag}{i}", prompt_ids=prompts[i % len(prompts)], max_tokens=n,
                            sampling=sampling, **kw) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=11)],
                         ids=["greedy", "t1"])
def test_overlap_gives_the_same_tokens_on_the_gpu(engines, sampling):
    off, on, prompts = engines
    lengths = (9, 17, 5, 24, 12, 7, 30, 3, 16, 11)  # ten requests through four slots
    before = on.steps_ahead
    ref, ref_final = drive(off, reqs(prompts, "a", sampling, lengths, ignore_eos=True))
    got, got_final = drive(on, reqs(prompts, "a", sampling, lengths, ignore_eos=True))
    assert on.steps_ahead - before > 20, "the overlapped engine hardly launched ahead"
    assert got == ref
    for rid, f in ref_final.items():
        assert (got_final[rid].finish_reason, got_final[rid].completion_tokens) == (f.finish_reason,
                                                                                    f.completion_tokens)
    assert not on.seqs and on.blocks.num_used == 0


def test_stop_tokens_and_a_cancellation_while_a_step_runs_ahead(engines):
    off, on, prompts = engines
    t1 = SamplingParams(temperature=1.0, seed=5)
    first, _ = drive(off, reqs(prompts, "s", t1, (20, 20, 20, 20), ignore_eos=True))
    stops = {rid: toks[6] for rid, toks in first.items()}
    stop_reqs = lambda tag: [GenerateRequest(request_id=f"{tag}{i}", prompt_ids=prompts[i], max_tokens=20,  # noqa
                                             sampling=t1, stop_token_ids=[stops[f"s{i}"]]) for i in range(4)]
    ref, ref_final = drive(off, stop_reqs("t"), abort_at={"t3": 3})
    got, got_final = drive(on, stop_reqs("t"), abort_at={"t3": 3})
    assert got == ref
    assert {r: f.finish_reason for r, f in got_final.items()} == {r: f.finish_reason for r, f in ref_final.items()}
    assert got_final["t3"].finish_reason == "cancelled"
    assert got_final["t3"].completion_tokens == len(got["t3"])
    assert all(np.isin(got[r][-1], stops[f"s{r[1:]}"]) for r in ("t0", "t1", "t2")
               if got_final[r].finish_reason == "stop")
    assert not on.seqs and on.blocks.num_used == 0
