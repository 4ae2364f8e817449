"""Mixed steps on the GPU engine: prompt chunks beside decoding sequences replay the verify graphs
(workers/cupy/gpu/verify.py) instead of launching every kernel from Python.

- random weights: a mixed step (decodes, a whole short prompt, a prompt chunk short of its end that wants no
  logits) gives the CPU model's logits to fp16 tolerance, in a graph of 8 and in one of 64 (both through cuBLAS's
  products since verify.py stopped taking the fused small ones), twice over different layouts on the same graphs; its in-graph argmax is the argmax of those
  logits; with `mixed_graphs` off the same step runs eagerly; a step past 256 tokens replays a 384 graph;
- the real model, through the engine: requests that arrive while others decode are admitted in mixed steps
  (none eager), with the overlap on and off alike, and greedy output starts as the eager engine's does.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_gemma3_gpu import PROMPTS, real, rel, step  # noqa: F401 (fixture)
from workers.cupy.sequence import Sequence

cp = pytest.importorskip("cupy")

from tests.gpu.test_speculation_gpu import small_models  # noqa: E402

RNG = np.random.default_rng()


def _seq(name: str, n: int, vocab: int) -> Sequence:
    return Sequence(request_id=name, token_ids=RNG.integers(0, vocab, n).tolist(), max_tokens=16)


def _runs(blocks, running, nxt, arriving) -> list:
    """A step's (sequence, tokens): each running sequence decodes its next token `nxt[i]`, each arriving one runs
    its whole prompt."""
    runs = []
    for b, s in enumerate(running):
        s.num_computed = len(s.token_ids)
        s.token_ids.append(int(nxt[b]))
        blocks.allocate(s, 1)
        runs.append((s, 1))
    for s in arriving:
        blocks.allocate(s, len(s.token_ids))
        runs.append((s, len(s.token_ids)))
    return runs


@pytest.mark.parametrize("new_len", [3, 20])  # 2 decodes + 3 new tokens: a graph of 8; 2 + 20 + 30: of 64
def test_mixed_step_graph_matches_cpu(new_len):
    cfg, cpu, gpu, kvs, blocks = small_models()
    running = [_seq("a", 600, cfg.vocab_size), _seq("b", 37, cfg.vocab_size)]  # one context past the 512 window
    for s in running:
        blocks.allocate(s, len(s.token_ids))
    c, _ = step([cpu, gpu], kvs, [(s, len(s.token_ids)) for s in running])  # 637 tokens: eager
    assert gpu.step_kinds["eager"] == 1
    nxt = np.argmax(c, axis=1)
    arriving = [_seq("c", new_len, cfg.vocab_size)]
    partial = _seq("d", 50, cfg.vocab_size)  # a prompt whose first chunk stops short of its end: no logits row
    for rnd in range(2):  # the second round replays the graphs already captured, over another layout
        runs = _runs(blocks, running, nxt, arriving)
        if new_len > 8:  # the cuBLAS size: the partial prompt's first chunk, then its rest
            chunk = 30 if rnd == 0 else 20
            blocks.allocate(partial, chunk)
            runs.append((partial, chunk))
        before = dict(gpu.step_kinds)
        c, g = step([cpu, gpu], kvs, runs)
        assert c.shape[0] == len(running) + len(arriving) + (new_len > 8 and rnd == 1)
        assert rel(g, c) < 1e-2
        assert gpu.step_kinds["mixed"] == before["mixed"] + 1 and gpu.step_kinds["eager"] == before["eager"]
        assert gpu.last_logits.data.ptr == gpu._verify.ws.logits.data.ptr  # the verify graph ran, not eager
        assert gpu.last_chosen.get().tolist() == np.argmax(g, axis=1).tolist()
        if new_len > 8:
            partial.num_computed += chunk
        running += arriving  # the arrivals' prompts ran in this step: they decode from the next one
        arriving = [_seq(f"e{rnd}", new_len + 1, cfg.vocab_size)]
        nxt = np.argmax(c[: len(running)], axis=1)  # the partial prompt's row, when it has one, comes last
    # the same kind of step with mixed graphs off: eager
    gpu.mixed_graphs = False
    runs = _runs(blocks, running, nxt, arriving)
    before = dict(gpu.step_kinds)
    c, g = step([cpu, gpu], kvs, runs)
    assert rel(g, c) < 1e-2
    assert gpu.step_kinds["eager"] == before["eager"] + 1 and gpu.step_kinds["mixed"] == before["mixed"]


def test_a_mixed_step_past_256_tokens_replays_a_large_graph():
    """The sizes past 256 tokens (create_gpu_engine adds 384 and 512 for batches over 128): nine decodes beside a
    300-token prompt (309 tokens) replay the 384 graph, with the CPU model's logits."""
    cfg, cpu, gpu, kvs, blocks = small_models(graph_sizes=(1, 4, 8, 16),
                                              verify_sizes=(4, 8, 16, 32, 64, 128, 256, 384))
    running = [_seq(str(i), 20 + i, cfg.vocab_size) for i in range(9)]
    for s in running:
        blocks.allocate(s, len(s.token_ids))
    c, _ = step([cpu, gpu], kvs, [(s, len(s.token_ids)) for s in running])  # nine prompts, 216 tokens: mixed
    assert gpu.step_kinds["mixed"] == 1
    runs = _runs(blocks, running, np.argmax(c, axis=1), [_seq("long", 300, cfg.vocab_size)])
    c, g = step([cpu, gpu], kvs, runs)
    assert c.shape[0] == 10 and rel(g, c) < 1e-2
    assert gpu.step_kinds["mixed"] == 2 and gpu.step_kinds["eager"] == 0
    assert gpu.last_logits.data.ptr == gpu._verify.ws.logits.data.ptr and 384 in gpu._verify.graphs
    assert gpu.last_chosen.get().tolist() == np.argmax(g, axis=1).tolist()


def _engine(real_model, mixed: bool, overlap: bool):
    from workers.cupy.gpu import create_gpu_engine

    info, weights, _ = real_model
    eng = create_gpu_engine(info, weights, block_size=16, num_blocks=1024, max_num_seqs=8, max_step_tokens=1024,
                            context_length=2048)
    eng.model.mixed_graphs, eng.overlap = mixed, overlap
    eng.model.capture_graphs(eng.kv, 16, verify=False)
    return eng


def _staggered(eng, prompts, max_tokens=24):
    """Two requests first, one more every 5 steps while they decode (each arrival's prompt rides in a step with
    the decoding sequences); greedy. Tokens per request and the forwards by path."""
    from workers.protocol import GenerateRequest, SamplingParams

    def add(i):
        eng.add(GenerateRequest(request_id=str(i), prompt_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0)))

    add(0)
    add(1)
    toks, n, steps = {str(i): [] for i in range(len(prompts))}, 2, 0
    before = dict(eng.model.step_kinds)
    while eng.has_work() or n < len(prompts):
        if steps % 5 == 4 and n < len(prompts):
            add(n)
            n += 1
        for o in eng.step():
            toks[o.request_id] += o.token_ids
        steps += 1
    kinds = {k: v - before.get(k, 0) for k, v in eng.model.step_kinds.items()}
    return [toks[str(i)] for i in range(len(prompts))], kinds


def test_real_model_arrivals_ride_mixed_graphs(real):  # noqa: F811
    info, _, tok = real
    texts = PROMPTS[:4] + ["Write a short poem about the sea:"]  # PROMPTS[4] (~600 tokens) fits no graph
    prompts = [[info.bos_token_id] + tok.encode(t).ids for t in texts]
    got = {}
    for mixed, overlap in ((True, True), (True, False), (False, False)):
        eng = _engine(real, mixed, overlap)
        got[mixed, overlap], kinds = _staggered(eng, prompts)
        assert all(len(t) == 24 for t in got[mixed, overlap])
        if mixed:
            assert kinds["mixed"] >= 3 and kinds["eager"] == 0, kinds  # every arrival's step replayed a graph
            assert eng.model._verify is not None
        else:
            assert kinds["mixed"] == 0 and kinds["eager"] >= 3, kinds
        if overlap:
            assert eng.steps_ahead > 0
    assert got[True, True] == got[True, False]  # the same kernels, launched ahead or not
    # graphs and eager forwards sum in another order (fused small products, cuBLAS at another M): a near-tie
    # later in 24 tokens may break the other way, as with cuda_graphs off (test_sampling_gpu.py)
    assert [t[:4] for t in got[True, False]] == [t[:4] for t in got[False, False]]


def test_real_model_a_burst_of_arrivals_beside_decodes_stays_on_the_graphs(real):  # noqa: F811
    """Four requests decode; four ~70-token prompts arrive at once (4 + 280 tokens, past the engine's largest
    graph of 256). With `fit_graphs` three join the next step and the fourth the step after, both replaying a
    graph; without it all four join one step, which runs eagerly. Every request gets all its tokens either way."""
    from workers.protocol import GenerateRequest, SamplingParams

    info, _, tok = real
    fox = tok.encode(PROMPTS[4]).ids
    short = [[info.bos_token_id] + tok.encode(t).ids for t in PROMPTS[:4]]
    long = [[info.bos_token_id] + tok.encode(f"Ticket {i}.").ids + fox[: 70] for i in range(4)]
    got = {}
    for fit in (True, False):
        eng = _engine(real, True, True)
        eng.fit_graphs = fit
        assert eng.model.mixed_step_tokens == 256
        toks = {}

        def add(name, ids):
            toks[name] = []
            eng.add(GenerateRequest(request_id=name, prompt_ids=ids, max_tokens=24, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0.0)))

        for i, ids in enumerate(short):
            add(f"s{i}", ids)
        for _ in range(3):  # prefilled, and decoding
            for o in eng.step():
                toks[o.request_id] += o.token_ids
        before = dict(eng.model.step_kinds)
        for i, ids in enumerate(long):
            add(f"l{i}", ids)
        while eng.has_work():
            for o in eng.step():
                toks[o.request_id] += o.token_ids
        kinds = {k: v - before.get(k, 0) for k, v in eng.model.step_kinds.items()}
        assert all(len(t) == 24 for t in toks.values()), {k: len(t) for k, t in toks.items()}
        if fit:
            assert kinds["eager"] == 0 and kinds["mixed"] >= 2, kinds
        else:
            assert kinds["eager"] >= 1, kinds
        got[fit] = toks
    assert {k: t[:4] for k, t in got[True].items()} == {k: t[:4] for k, t in got[False].items()}
