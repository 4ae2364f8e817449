"""The GPU model against the engine's CPU (NumPy, fp32) model: same step batches, same KV bookkeeping.

- random weights of Gemma 3 270M's shapes (6 layers, so one global layer): logits of a prefill step and of
  graph-replayed decode steps to fp16 tolerance;
- the real bundled GGUF: identical greedy continuations through the whole engine (scheduler, paged cache,
  CUDA graphs) on several prompts, and last-position logits to bf16 tolerance.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.required import absent
from workers.cupy.batch import build_batch
from workers.cupy.gemma3 import Gemma3, Gemma3Config
from workers.cupy.kv_cache import BlockManager
from workers.cupy.ops import Ops
from workers.cupy.sequence import Sequence

cp = pytest.importorskip("cupy")

from workers.cupy.gpu.gemma3 import GpuGemma3  # noqa: E402

RNG = np.random.default_rng()
BS = 16


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_weights(cfg: Gemma3Config) -> dict:
    h, hd, f = cfg.hidden, cfg.head_dim, cfg.ffn
    w = {"token_embd.weight": RNG.standard_normal((cfg.vocab_size, h)).astype(np.float32) * 0.05,
         "output_norm.weight": 1 + RNG.standard_normal(h).astype(np.float32) * 0.1}
    shapes = {"attn_q": (cfg.n_heads * hd, h), "attn_k": (cfg.n_kv_heads * hd, h), "attn_v": (cfg.n_kv_heads * hd, h),
              "attn_output": (h, cfg.n_heads * hd), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    norms = {"attn_norm": h, "attn_q_norm": hd, "attn_k_norm": hd, "post_attention_norm": h, "ffn_norm": h,
             "post_ffw_norm": h}
    for i in range(cfg.n_layers):
        for name, shape in shapes.items():
            w[f"blk.{i}.{name}.weight"] = RNG.standard_normal(shape).astype(np.float32) / np.sqrt(shape[1])
        for name, n in norms.items():
            w[f"blk.{i}.{name}.weight"] = 1 + RNG.standard_normal(n).astype(np.float32) * 0.1
    return w


def step(models, kvs, scheduled, drafts=None):
    """Run one step of `scheduled` (sequence, n) through each model (with speculative `drafts`, as
    build_batch takes them); host logits per model."""
    out = []
    for model, kv in zip(models, kvs):
        xp = model.xp
        batch = build_batch(scheduled, BS, xp, drafts)
        logits = model.forward(batch, kv)
        out.append(logits.get() if hasattr(logits, "get") else np.asarray(logits))
    return out


# fused small-batch products / cuBLAS with padding rows; fp16 and bf16 (8 bits of mantissa: looser)
@pytest.mark.parametrize("graph_sizes,act,tol", [((1, 4, 8), "float16", 1e-2), ((16,), "float16", 1e-2),
                                                 ((1, 4, 8), "bfloat16", 3e-2)])
def test_random_weights_prefill_and_graph_decode(graph_sizes, act, tol):
    cfg = Gemma3Config(n_layers=6, hidden=640, n_heads=4, n_kv_heads=1, head_dim=256, ffn=2048, vocab_size=8192,
                       eps=1e-6, rope_base_global=1e6, query_scale=1 / 16)
    w = random_weights(cfg)
    cpu = Gemma3(cfg, w, Ops(np))
    gpu = GpuGemma3(cfg, w, act=act, graph_sizes=graph_sizes, max_model_len=2048)
    nb = 200
    kvs = [cpu.kv_storage(nb, BS), gpu.kv_storage(nb, BS)]
    blocks = BlockManager(nb, BS)
    lens = [600, 37, 1, 130]  # one prompt longer than the 512 window
    seqs = [Sequence(request_id=str(i), token_ids=RNG.integers(0, cfg.vocab_size, n).tolist(), max_tokens=8)
            for i, n in enumerate(lens)]
    for s in seqs:
        blocks.allocate(s, len(s.token_ids))
    c, g = step([cpu, gpu], kvs, [(s, len(s.token_ids)) for s in seqs])
    assert rel(g, c) < tol
    for _ in range(3):  # decode steps: 4 live rows on the 4-row graph, then 3 on the 4-row graph (padding)
        for s, nxt in zip(seqs, np.argmax(c, axis=1)):
            s.num_computed = len(s.token_ids)
            s.token_ids.append(int(nxt))
            blocks.allocate(s, 1)
        c, g = step([cpu, gpu], kvs, [(s, 1) for s in seqs])
        assert rel(g, c) < tol
        assert gpu.last_chosen.get().tolist() == np.argmax(g, axis=1).tolist()
    seqs = seqs[1:]
    for s, nxt in zip(seqs, np.argmax(c[1:], axis=1)):
        s.num_computed = len(s.token_ids)
        s.token_ids.append(int(nxt))
        blocks.allocate(s, 1)
    c, g = step([cpu, gpu], kvs, [(s, 1) for s in seqs])
    assert rel(g, c) < tol


def model_path() -> Path | None:
    """PULSE_GGUF's file (an error when it names a missing file), else the bundled model where installed."""
    p = os.environ.get("PULSE_GGUF")
    if p:
        if not Path(p).is_file():
            raise FileNotFoundError(f"PULSE_GGUF names a missing file: {p}")
        return Path(p)
    try:
        from workers.protocol.model import bundled_model_path

        return bundled_model_path()
    except Exception:  # the bundled-model package is not installed here
        return None


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. " * 60,  # ~600 tokens: crosses the 512-token window
]


@pytest.fixture(scope="module")
def real():
    path = model_path()
    if path is None or not path.exists():
        absent("no GGUF model (set PULSE_GGUF)", env="PULSE_REQUIRE_GPU")
    from workers.cupy.weights import load_weights
    from workers.protocol.model import load_model_info, load_tokenizer

    info = load_model_info(str(path))
    return info, load_weights(path), load_tokenizer(str(path))


def test_real_model_greedy_matches_cpu(real):
    from workers.cupy.engine import create_engine
    from workers.cupy.gpu import create_gpu_engine
    from workers.protocol import GenerateRequest, SamplingParams

    info, weights, tok = real
    kw = dict(block_size=BS, num_blocks=512, max_num_seqs=8, max_step_tokens=1024, context_length=2048)
    engines = {"cpu": create_engine(info, weights, np, **kw), "gpu": create_gpu_engine(info, weights, **kw)}
    greedy = SamplingParams(temperature=0.0)
    results = {}
    for name, eng in engines.items():
        outs = {str(i): [] for i in range(len(PROMPTS))}
        for i, text in enumerate(PROMPTS):
            ids = [info.bos_token_id] + tok.encode(text).ids
            eng.add(GenerateRequest(request_id=str(i), prompt_ids=ids, max_tokens=32, sampling=greedy,
                                    ignore_eos=True))
        while eng.has_work():
            for o in eng.step():
                outs[o.request_id] += o.token_ids
        results[name] = outs
    for i in range(len(PROMPTS)):
        assert len(results["cpu"][str(i)]) == 32
        assert results["gpu"][str(i)] == results["cpu"][str(i)], f"prompt {i}"

    # last-position logits of each prompt, one at a time
    cpu_m, gpu_m = engines["cpu"].model, engines["gpu"].model
    for text in PROMPTS:
        ids = [info.bos_token_id] + tok.encode(text).ids
        s = Sequence(request_id="x", token_ids=ids, max_tokens=1)
        blocks = BlockManager(64, BS)
        blocks.allocate(s, len(ids))
        c, g = step([cpu_m, gpu_m], [cpu_m.kv_storage(64, BS), gpu_m.kv_storage(64, BS)], [(s, len(ids))])
        assert rel(g, c) < 1e-2
        cos = float(np.sum(g * c) / np.linalg.norm(g) / np.linalg.norm(c))
        assert cos > 0.9999
