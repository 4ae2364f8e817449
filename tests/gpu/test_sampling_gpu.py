"""Sampling on the device (gpu/sampling.cu through Kernels.sample and GpuSampler) against the CPU sampler.

- the kernel's draw is the NumPy sampler's draw: the same ids for the same logits and keys, greedy and
  sampled rows in one launch, on a 262k vocabulary;
- over many keys its draws follow softmax(logits / T) (chi-square), and truncated rows (top-k, top-p)
  keep exactly their support;
- the logprob it computes beside the draw is the log-softmax of the chosen token;
- the real model on the GPU engine: a seeded request at temperature 1 gives the same tokens alone, in a
  batch, and with speculation (verify graphs), and the steps' draws came from the graphs (no eager path).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from tests.gpu.test_gemma3_gpu import PROMPTS, real  # noqa: F401 (fixture)
from workers.cupy.rng import row_key
from workers.cupy.sampler import Sampler, SampleRow
from workers.protocol import GenerateRequest, SamplingParams

cp = pytest.importorskip("cupy")

from workers.cupy.gpu import GpuSampler
from workers.cupy.gpu.kernels import DeviceDraws, Kernels, argmax_chunks

RNG = np.random.default_rng()


@pytest.fixture(scope="module")
def k():
    return Kernels(256, 4, "float16")


def device_draw(k, logits: np.ndarray, rows: list[SampleRow]):
    """(ids, logprobs) from one launch of the sampling kernels."""
    s, v = logits.shape
    params = np.zeros((s, 4), np.int32)
    DeviceDraws.pack(rows, params)
    n = argmax_chunks(v)
    part = [cp.full((s, n), np.nan, t) if t == cp.float32 else cp.full((s, n), -1, t)
            for t in (cp.float32, cp.int32, cp.float32, cp.float32)]
    out, lp = cp.full((s,), -1, cp.int32), cp.full((s,), np.nan, cp.float32)
    k.sample(cp.asarray(logits), cp.asarray(params), out, lp, *part)
    return out.get().astype(np.int64), lp.get()


def test_kernel_draw_is_the_cpu_draw_on_a_full_vocabulary(k):
    v = 262144
    logits = (RNG.standard_normal((8, v)) * 3).astype(np.float32)
    temps = [0.0, 1.0, 1.0, 0.7, 1.5, 0.0, 1.0, 0.3]
    seed = int(RNG.integers(1 << 62))
    rows = [SampleRow(SamplingParams(temperature=t), row_key(seed, i), logprobs=0) for i, t in enumerate(temps)]
    ids, lp = device_draw(k, logits, rows)
    cpu = Sampler(np).choose(logits, rows)
    assert ids.tolist() == cpu.tolist()
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    assert np.allclose(lp, ref[np.arange(8), ids], atol=2e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_kernel_draws_follow_the_softmax(k, temperature):
    v, n = 16, 6000
    logits = RNG.normal(0, 1.5, v).astype(np.float32)
    seed = int(RNG.integers(1 << 62))
    rows = [SampleRow(SamplingParams(temperature=temperature), row_key(seed, i)) for i in range(n)]
    ids, _ = device_draw(k, np.tile(logits, (n, 1)), rows)
    p = np.exp((logits / temperature - (logits / temperature).max()).astype(np.float64))
    p /= p.sum()
    big = p * n >= 5
    observed = np.bincount(ids, minlength=v)
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(p[big] * n, p[~big].sum() * n)
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()
    assert chisquare(obs[keep], exp).pvalue > 1e-3


@pytest.mark.parametrize("params, support", [(SamplingParams(top_k=3), 3), (SamplingParams(top_p=0.5), None)])
def test_gpu_sampler_truncated_rows_keep_their_support(params, support):
    sampler = GpuSampler(type("M", (), {"kernels": Kernels(256, 4, "float16"),
                                        "cfg": type("C", (), {"vocab_size": 64})()})())
    logits = RNG.normal(0, 2, 64).astype(np.float32)
    rows = [SampleRow(params, row_key(3, i)) for i in range(500)]
    ids, _ = sampler.sample(cp.asarray(np.tile(logits, (len(rows), 1))), rows)
    kept = Sampler(np).truncated_probs(logits[None, :], rows[:1], np.array([1.0], np.float32))[0]
    assert set(ids.tolist()) <= set(np.flatnonzero(kept > 0).tolist())
    if support is not None:
        assert len(set(ids.tolist())) == support
    cpu, _ = Sampler(np).sample(np.tile(logits, (len(rows), 1)), rows)
    assert ids.tolist() == cpu.tolist()  # the eager device path draws what the CPU path draws


def _run(eng, prompts, sampling, max_tokens=24, **extra):
    for i, ids in enumerate(prompts):
        eng.add(GenerateRequest(request_id=str(i), prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True,
                                sampling=sampling, **extra))
    toks, lps, finals = {str(i): [] for i in range(len(prompts))}, {str(i): [] for i in range(len(prompts))}, {}
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.token_ids
            lps[o.request_id] += o.logprobs or []
            if o.finish_reason:
                finals[o.request_id] = o
    keys = [str(i) for i in range(len(prompts))]
    return [toks[r] for r in keys], [finals[r] for r in keys], [lps[r] for r in keys]


def test_real_model_seeded_sampling_is_batch_and_speculation_invariant_on_gpu(real, monkeypatch):  # noqa: F811
    from tests.gpu.test_speculation_gpu import _spec_engine
    from tests.integration.test_speculation import EDIT

    from workers.cupy import speculative

    monkeypatch.setattr(speculative, "MISS_WAIT_MAX", 0)  # every step searches: more verify steps to hold equal
    info, _, tok = real
    prompts = [[info.bos_token_id] + tok.encode(t).ids for t in [EDIT, PROMPTS[1], PROMPTS[4], PROMPTS[2]]]
    sampling = SamplingParams(temperature=1.0, seed=1234)
    alone, _, _ = _run(_spec_engine(real, 0), prompts[:1], sampling)
    batched, _, _ = _run(_spec_engine(real, 0), prompts[1:] + prompts[:1], sampling)
    eager = []  # the eager path, counted: the steps' graphs (and eager forwards) drew every token
    base = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, *a, **kw: eager.append(1) or base(self, *a, **kw))
    eng = _spec_engine(real, 4)
    spec, finals, _ = _run(eng, prompts, sampling)
    assert alone[0] == batched[-1] == spec[0]
    assert finals[0].drafted_tokens > 0 and eng.model._verify is not None
    assert not eager
    # the chosen token's logprob comes from the same pass: the same tokens, and log-probabilities
    with_lp, _, lps = _run(_spec_engine(real, 4), prompts[:1], sampling, logprobs=0)
    assert with_lp[0] == alone[0] and [e.token_id for e in lps[0]] == alone[0]
    assert all(-30 < e.logprob <= 1e-4 for e in lps[0])
    assert not eager


def test_real_model_penalties_on_gpu_take_the_penalized_argmax(real):  # noqa: F811
    """Presence/frequency penalties on the device's logits (engine.apply_penalties with CuPy): each greedy
    token is the argmax of the top-20 logprobs less the penalties of the output so far, the penalty changed
    some choices, and an unpenalized sequence in the same batch keeps its greedy tokens."""
    from tests.gpu.test_speculation_gpu import _spec_engine
    from tests.integration.test_penalties import (
        PENALIZED,
        PROMPT,
        assert_penalized_argmax,
    )

    info, _, tok = real
    ids = [info.bos_token_id] + tok.encode(PROMPT).ids
    plain, _, _ = _run(_spec_engine(real, 4), [ids], SamplingParams(temperature=0.0))
    eng = _spec_engine(real, 4)
    eng.add(GenerateRequest(request_id="p", prompt_ids=ids, max_tokens=24, ignore_eos=True, sampling=PENALIZED,
                            logprobs=20))
    eng.add(GenerateRequest(request_id="u", prompt_ids=ids, max_tokens=24, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.0), max_draft_tokens=0))
    toks, entries, got = [], [], []
    while eng.has_work():
        for o in eng.step():
            if o.request_id == "u":
                got += o.token_ids
                continue
            toks += o.token_ids
            entries += o.logprobs
    assert got == plain[0]  # the unpenalized row beside it
    changed = assert_penalized_argmax(toks, entries, PENALIZED, 2e-2)  # fp16 logits
    assert len(toks) == 24 and changed > 0


def test_graphs_captured_at_start_are_the_ones_decode_uses(real):  # noqa: F811
    """capture_graphs (what build_engine calls before a worker is ready) builds the decode and verify graphs;
    the first request's steps then run on them (no capture in its step) and give the lazily-captured tokens."""
    from tests.gpu.test_speculation_gpu import _spec_engine

    info, _, tok = real
    prompts = [[info.bos_token_id] + tok.encode(t).ids for t in PROMPTS[:3]]
    lazy, _, _ = _run(_spec_engine(real, 4), prompts, SamplingParams(temperature=0.0))
    eng = _spec_engine(real, 4)
    eng.model.capture_graphs(eng.kv, 8, verify=True)
    decode, verify = eng.model._graphs, eng.model._verify
    assert decode is not None and verify is not None and decode.graphs
    early, _, _ = _run(eng, prompts, SamplingParams(temperature=0.0))
    assert early == lazy
    assert eng.model._graphs is decode and eng.model._verify is verify


def test_cuda_graphs_off_runs_every_step_eagerly_with_the_same_tokens(real):  # noqa: F811
    """`workers.engine.cuda_graphs: false` reaches the model (build_engine passes no graph sizes): no decode or
    verify graph is built or replayed, every forward is eager, and greedy output starts as the graphs' does (the
    eager steps multiply through cuBLAS, the graphs' small batches through the fused GEMV kernels: fp16 sums in
    another order, so a near-tie later in 24 tokens may break the other way)."""
    from policy.config import PulseConfig
    from policy.profiles import builtin_profiles
    from workers.cupy.backend import build_engine

    info, _, tok = real
    prompts = [[info.bos_token_id] + tok.encode(t).ids for t in PROMPTS[:3]]
    got = {}
    for graphs in (True, False):
        config = PulseConfig.model_validate({"model": {"path": info.path}, "workers": {"backend": "cupy", "engine": {
            "device": "cuda", "max_num_seqs": 8, "kv_blocks": 1024, "cuda_graphs": graphs}}})
        eng = build_engine(config, builtin_profiles()["cuda"], info)
        got[graphs], _, _ = _run(eng, prompts, SamplingParams(temperature=0.0))
        kinds = eng.model.step_kinds
        if graphs:
            assert kinds["graph"] + kinds["verify"] > 0
        else:
            assert eng.model._graphs is None and eng.model._verify is None
            assert kinds["graph"] == kinds["verify"] == 0 and kinds["eager"] > 0
    assert [t[:4] for t in got[False]] == [t[:4] for t in got[True]]
    assert all(len(t) == 24 for t in got[False])
