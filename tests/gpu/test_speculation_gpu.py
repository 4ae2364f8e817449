"""Speculative decoding on the GPU engine: verify steps replayed as CUDA graphs (workers/cupy/gpu/verify.py).

- random weights: a verify step (several sequences, drafts of different lengths, decode-only rows beside
  them) gives the CPU model's logits to fp16 tolerance through both graph kinds (fused small products up to
  8 tokens, cuBLAS above), and the in-graph argmax is the argmax of those logits;
- the real model: greedy tokens with speculation (K 1, 3, 6; 8-token blocks so drafts cross blocks; a
  prompt past the 512 window; Predicted Outputs) are identical to the same GPU engine without it.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_gemma3_gpu import PROMPTS, random_weights, real, rel, step  # noqa: F401 (fixture)
from tests.integration.test_speculation import EDIT, SOURCE  # the same code edit as the CPU tests
from workers.cupy.gemma3 import Gemma3, Gemma3Config
from workers.cupy.kv_cache import BlockManager
from workers.cupy.ops import Ops
from workers.cupy.sequence import Sequence

cp = pytest.importorskip("cupy")

from workers.cupy.gpu.gemma3 import GpuGemma3  # noqa: E402

RNG = np.random.default_rng()
BS = 16


def small_models(nb: int = 256, graph_sizes=(1, 4, 8), **kw):
    """A 6-layer Gemma 3 with random weights as the CPU model and the GPU model (decode graphs of `graph_sizes`
    rows; `kw` to GpuGemma3, e.g. verify_sizes), their KV storages of `nb` blocks and a block manager:
    (cfg, cpu, gpu, kvs, blocks)."""
    cfg = Gemma3Config(n_layers=6, hidden=640, n_heads=4, n_kv_heads=1, head_dim=256, ffn=2048, vocab_size=8192,
                       eps=1e-6, rope_base_global=1e6, query_scale=1 / 16)
    w = random_weights(cfg)
    cpu = Gemma3(cfg, w, Ops(np))
    gpu = GpuGemma3(cfg, w, act="float16", graph_sizes=graph_sizes, max_model_len=2048, **kw)
    return cfg, cpu, gpu, [cpu.kv_storage(nb, BS), gpu.kv_storage(nb, BS)], BlockManager(nb, BS)


@pytest.mark.parametrize("draft_lens", [(3, 0, 2), (6, 0, 7, 1)])  # 8 tokens (small path), 19 (cuBLAS)
def test_verify_step_graph_matches_cpu(draft_lens):
    cfg, cpu, gpu, kvs, blocks = small_models()
    lens = [600, 37, 130, 5][: len(draft_lens)]  # one context past the 512 window
    seqs = [Sequence(request_id=str(i), token_ids=RNG.integers(0, cfg.vocab_size, n).tolist(), max_tokens=16)
            for i, n in enumerate(lens)]
    for s in seqs:
        blocks.allocate(s, len(s.token_ids))
    c, _ = step([cpu, gpu], kvs, [(s, len(s.token_ids)) for s in seqs])
    nxt = np.argmax(c, axis=1)  # the prefill step's one logits row per sequence
    for _ in range(2):  # twice: the second replays graphs already captured, over new inputs
        drafts, runs = {}, []
        for b, s in enumerate(seqs):
            s.num_computed = len(s.token_ids)
            s.token_ids.append(int(nxt[b]))
            if draft_lens[b]:
                drafts[b] = RNG.integers(0, cfg.vocab_size, draft_lens[b]).tolist()
            blocks.allocate(s, 1 + draft_lens[b])
            runs.append((s, 1 + draft_lens[b]))
        c, g = step([cpu, gpu], kvs, runs, drafts)
        assert c.shape[0] == sum(n for _, n in runs)
        assert rel(g, c) < 1e-2
        assert gpu.last_logits.data.ptr == gpu._verify.ws.logits.data.ptr  # the verify graph ran, not eager
        assert gpu.last_chosen.get().tolist() == np.argmax(g, axis=1).tolist()
        # every draft rejected: each sequence goes on from its real token's row (the first of its run);
        # the drafts' K/V stay in the cache past the sequence's length and get overwritten
        firsts = np.cumsum([0] + [n for _, n in runs])[:-1]
        nxt = np.argmax(c[firsts], axis=1)
    assert set(gpu._verify.graphs) == set(gpu.verify_sizes)


def _spec_engine(real_model, k: int, block_size: int = 8):
    from policy.profiles import DeviceProfile, SpeculationRule
    from workers.cupy.gpu import create_gpu_engine
    from workers.cupy.speculative import Speculator

    info, weights, _ = real_model
    eng = create_gpu_engine(info, weights, block_size=block_size, num_blocks=1024, max_num_seqs=8,
                            max_step_tokens=1024, context_length=2048)
    eng.speculator = Speculator(DeviceProfile(name=f"k{k}", max_draft_tokens=max(k, 1),
                                              speculation=[SpeculationRule(max_context=10**9, k=k)]))
    return eng


def _generate(eng, prompts, max_tokens, extra=None):
    from workers.protocol import GenerateRequest, SamplingParams

    for i, ids in enumerate(prompts):
        eng.add(GenerateRequest(request_id=str(i), prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0), **(extra or {}).get(i, {})))
    toks, finals = {str(i): [] for i in range(len(prompts))}, {}
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.token_ids
            if o.finish_reason:
                finals[o.request_id] = o
    return [toks[str(i)] for i in range(len(prompts))], [finals[str(i)] for i in range(len(prompts))]


def test_real_model_speculation_is_lossless_on_gpu(real, monkeypatch):  # noqa: F811
    from workers.cupy import speculative

    monkeypatch.setattr(speculative, "MISS_WAIT_MAX", 0)  # every step searches: more verify steps to hold equal
    info, _, tok = real
    prompts = [[info.bos_token_id] + tok.encode(t).ids for t in [EDIT, PROMPTS[1], PROMPTS[4]]]
    reference, _ = _generate(_spec_engine(real, 0), prompts, 40)
    for k in (1, 3, 6):
        eng = _spec_engine(real, k)
        tokens, finals = _generate(eng, prompts, 40)
        assert tokens == reference, f"K={k}"
        assert finals[0].drafted_tokens > 0 and finals[0].accepted_tokens > 0
        assert eng.model._verify is not None  # verify steps went through the graphs
    # Predicted Outputs: the original file as the prediction of the edit
    pred = tok.encode(SOURCE).ids
    tokens, finals = _generate(_spec_engine(real, 6), prompts[:1], 40, {0: {"prediction_ids": pred}})
    assert tokens == reference[:1]
    assert finals[0].drafted_tokens > 0
