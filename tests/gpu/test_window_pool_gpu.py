"""The sliding-window KV pool on the GPU (workers/cupy/kv_cache.py): the local layers' own block tables and
slots through the eager path and the decode CUDA graphs, against the NumPy model with the same two pools.

- random weights, 6 layers (one global) with a 64-token window and a 40-block local pool: a mixed prefill
  step, then graph-replayed decode steps whose local tables have slid-out (-1 -> 0) entries; logits to fp16
  tolerance at every step;
- the real GGUF through both engines built with a small local pool (137 blocks beside 851 global ones): the
  same greedy tokens past the 512-token window, equal to the one-pool CPU engine's.
"""
from __future__ import annotations

import numpy as np
import pytest

from workers.cupy.gemma3 import Gemma3, Gemma3Config
from workers.cupy.kv_cache import BlockManager
from workers.cupy.ops import Ops
from workers.cupy.sequence import Sequence

cp = pytest.importorskip("cupy")

from tests.gpu.test_gemma3_gpu import BS, PROMPTS, random_weights, real, rel, step  # noqa: E402,F401
from workers.cupy.gpu.gemma3 import GpuGemma3  # noqa: E402

RNG = np.random.default_rng(7)


def test_random_weights_two_pools_prefill_and_graph_decode():
    cfg = Gemma3Config(n_layers=6, hidden=640, n_heads=4, n_kv_heads=1, head_dim=256, ffn=2048, vocab_size=8192,
                       eps=1e-6, rope_base_global=1e6, query_scale=1 / 16, window=64)
    w = random_weights(cfg)
    cpu = Gemma3(cfg, w, Ops(np))
    gpu = GpuGemma3(cfg, w, act="float16", graph_sizes=(1, 4, 8), max_model_len=1024)
    nb, nl = 200, 40
    kvs = [cpu.kv_storage(nb, BS, num_local=nl), gpu.kv_storage(nb, BS, num_local=nl)]
    assert kvs[1].two_pools and kvs[1].local_k.shape[:2] == (5, nl + 1)
    blocks = BlockManager(nb, BS, num_local=nl, window=cfg.window)
    seqs = [Sequence(request_id=str(i), token_ids=RNG.integers(0, cfg.vocab_size, n).tolist(), max_tokens=40)
            for i, n in enumerate([300, 37, 1, 130])]
    for s in seqs:
        blocks.allocate(s, len(s.token_ids))
    c, g = step([cpu, gpu], kvs, [(s, len(s.token_ids)) for s in seqs])
    assert rel(g, c) < 1e-2
    for s in seqs:
        s.num_computed = len(s.token_ids)
        blocks.commit_full_blocks(s)  # the local blocks behind each window go back to the pool
    assert -1 in seqs[0].local_table and blocks.num_local_used < blocks.num_used
    for i in range(40):  # decode on the 4-row graph; sequence 2 crosses the window, 0 and 3 slide
        for s, nxt in zip(seqs, np.argmax(c, axis=1)):
            s.token_ids.append(int(nxt))
            blocks.allocate(s, 1)
        c, g = step([cpu, gpu], kvs, [(s, 1) for s in seqs])
        for s in seqs:
            s.num_computed = len(s.token_ids)
            blocks.commit_full_blocks(s)
        assert rel(g, c) < 1e-2, f"decode step {i}"
        assert gpu.last_chosen.get().tolist() == np.argmax(g, axis=1).tolist()
    assert max(sum(b >= 0 for b in s.local_table) for s in seqs) <= cfg.window // BS + 2


def test_real_model_two_pools_gpu_equals_cpu_past_the_window(real):
    from workers.cupy.engine import create_engine
    from workers.cupy.gpu import create_gpu_engine
    from workers.protocol import GenerateRequest, SamplingParams

    info, weights, tok = real
    kw = dict(block_size=BS, num_blocks=256, max_num_seqs=2, max_step_tokens=128, context_length=2048)
    engines = {"cpu1": create_engine(info, weights, np, window_pool=False, **kw),
               "cpu": create_engine(info, weights, np, **kw), "gpu": create_gpu_engine(info, weights, **kw)}
    assert engines["gpu"].blocks.local.num_blocks == 137 and engines["gpu"].blocks.num_blocks == 851
    texts = [PROMPTS[4], " ".join(PROMPTS[:4]) * 20, PROMPTS[0]]  # ~600 and ~700 tokens, and a short one
    results = {}
    for name, eng in engines.items():
        outs = {str(i): [] for i in range(len(texts))}
        for i, text in enumerate(texts):
            ids = [info.bos_token_id] + tok.encode(text).ids
            eng.add(GenerateRequest(request_id=str(i), prompt_ids=ids, max_tokens=32,
                                    sampling=SamplingParams(temperature=0.0), ignore_eos=True))
        while eng.has_work():
            for o in eng.step():
                outs[o.request_id] += o.token_ids
        results[name] = outs
    assert results["cpu"] == results["cpu1"]
    for i in range(len(texts)):
        assert results["gpu"][str(i)] == results["cpu"][str(i)], f"prompt {i}"
    assert engines["gpu"].model._graphs is not None and engines["gpu"].model._graphs.two_pools  # graphs replayed
