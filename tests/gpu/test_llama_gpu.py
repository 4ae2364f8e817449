"""The Llama GPU model against the engine's CPU (NumPy, fp32) Llama: same step batches, same KV bookkeeping.

- fresh random weights of SmolLM2 135M's shapes (head_dim 64, 9 query heads on 3 KV heads) and of a head_dim
  128 model with an untied head and rope_freqs factors: logits of a mixed prefill step and of graph-replayed
  decode steps to fp16 / bf16 tolerance, with every workspace buffer and the KV cache filled with NaN first
  (a row or slot a kernel forgets to write shows up);
- the real SmolLM2 135M Instruct GGUF (Q4_1): greedy continuations through the whole engine (scheduler, paged
  cache, CUDA graphs) on several prompts agree with the CPU engine's (whose tokens
  tests/integration/test_engine_llamacpp_parity.py checks against llama.cpp's) and, where llama-server is
  built, with llama.cpp's own; last-position logits close.
"""
from __future__ import annotations

import numpy as np
import pytest

from workers.cupy.batch import build_batch
from workers.cupy.kv_cache import BlockManager
from workers.cupy.llama import Llama, LlamaConfig
from workers.cupy.ops import Ops
from workers.cupy.sequence import Sequence

cp = pytest.importorskip("cupy")

from workers.cupy.gpu.gemma3 import Workspace
from workers.cupy.gpu.llama import GpuLlama

RNG = np.random.default_rng()
BS = 16
SMOLLM2 = LlamaConfig(n_layers=4, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn=1536, vocab_size=8192,
                      eps=1e-5, rope_base=100_000.0)
HEAD128 = LlamaConfig(n_layers=3, hidden=512, n_heads=8, n_kv_heads=2, head_dim=128, ffn=1024, vocab_size=4096,
                      eps=1e-5, rope_base=500_000.0, rope_scale=2.0)


def poison(a) -> None:
    """NaN in every float (and bf16-as-uint16) buffer; integer buffers (ids, counters) keep their contents."""
    if a.dtype == cp.uint16:
        a.fill(0x7FC0)  # a bf16 NaN
    elif a.dtype.kind == "f":
        a.fill(cp.nan)


@pytest.fixture(autouse=True)
def nan_workspaces(monkeypatch):
    allocate = Workspace.allocate.__func__

    def poisoned(cls, *args, **kw):
        ws = allocate(cls, *args, **kw)
        for name in ws.__dataclass_fields__:
            if name != "att_count":
                poison(getattr(ws, name))
        return ws

    monkeypatch.setattr(Workspace, "allocate", classmethod(poisoned))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_weights(cfg: LlamaConfig, tied: bool, rope_freqs: bool) -> dict:
    h, hd, f = cfg.hidden, cfg.head_dim, cfg.ffn
    w = {"token_embd.weight": RNG.standard_normal((cfg.vocab_size, h)).astype(np.float32) * 0.05,
         "output_norm.weight": 1 + RNG.standard_normal(h).astype(np.float32) * 0.1}
    if not tied:
        w["output.weight"] = RNG.standard_normal((cfg.vocab_size, h)).astype(np.float32) * 0.05
    if rope_freqs:
        w["rope_freqs.weight"] = np.linspace(1.0, 8.0, hd // 2).astype(np.float32)
    shapes = {"attn_q": (cfg.n_heads * hd, h), "attn_k": (cfg.n_kv_heads * hd, h), "attn_v": (cfg.n_kv_heads * hd, h),
              "attn_output": (h, cfg.n_heads * hd), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    for i in range(cfg.n_layers):
        for name, shape in shapes.items():
            w[f"blk.{i}.{name}.weight"] = RNG.standard_normal(shape).astype(np.float32) / np.sqrt(shape[1])
        for name in ("attn_norm", "ffn_norm"):
            w[f"blk.{i}.{name}.weight"] = 1 + RNG.standard_normal(h).astype(np.float32) * 0.1
    return w


def gpu_kv(model, nb: int):
    kv = model.kv_storage(nb, BS)
    for a in list(kv.k) + list(kv.v):
        poison(a)
    return kv


def step(models, kvs, scheduled):
    out = []
    for model, kv in zip(models, kvs):
        logits = model.forward(build_batch(scheduled, BS, model.xp), kv)
        out.append(logits.get() if hasattr(logits, "get") else np.asarray(logits))
    return out


def advance(seqs, blocks, logits):
    for s, nxt in zip(seqs, np.argmax(logits, axis=1)):
        s.num_computed = len(s.token_ids)
        s.token_ids.append(int(nxt))
        blocks.allocate(s, 1)


# cuBLAS for every step size; graphs with padding rows; fp16 and bf16 (8 bits of mantissa: looser)
@pytest.mark.parametrize("cfg,tied,freqs", [(SMOLLM2, True, False), (HEAD128, False, True)], ids=["hd64", "hd128"])
@pytest.mark.parametrize("graph_sizes,act,tol", [((1, 4, 8), "float16", 1e-2), ((16,), "float16", 1e-2),
                                                 ((1, 4, 8), "bfloat16", 3e-2)])
def test_random_weights_prefill_and_graph_decode(cfg, tied, freqs, graph_sizes, act, tol):
    w = random_weights(cfg, tied, freqs)
    cpu = Llama(cfg, w, Ops(np))
    gpu = GpuLlama(cfg, w, act=act, graph_sizes=graph_sizes, max_model_len=2048)
    nb = 200
    kvs = [cpu.kv_storage(nb, BS), gpu_kv(gpu, nb)]
    blocks = BlockManager(nb, BS)
    lens = [600, 37, 1, 130]  # one prompt past the attention kernel's 256-key chunk
    seqs = [Sequence(request_id=str(i), token_ids=RNG.integers(0, cfg.vocab_size, n).tolist(), max_tokens=8)
            for i, n in enumerate(lens)]
    for s in seqs:
        blocks.allocate(s, len(s.token_ids))
    c, g = step([cpu, gpu], kvs, [(s, len(s.token_ids)) for s in seqs])
    assert rel(g, c) < tol
    for _ in range(3):  # decode steps: 4 live rows on the 4-row graph (16-row: 12 padding rows)
        advance(seqs, blocks, c)
        c, g = step([cpu, gpu], kvs, [(s, 1) for s in seqs])
        assert rel(g, c) < tol
        assert gpu.last_chosen.get().tolist() == np.argmax(g, axis=1).tolist()
    seqs = seqs[1:]  # 3 live rows on the 4-row graph
    advance(seqs, blocks, c[1:])
    c, g = step([cpu, gpu], kvs, [(s, 1) for s in seqs])
    assert rel(g, c) < tol


PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. " * 40,  # ~400 tokens: more than one attention chunk
]
N_TOKENS, N_MATCH = 32, 10


@pytest.fixture(scope="module")
def smollm2():
    from workers.cupy.weights import load_weights
    from workers.protocol.model import (
        SMOLLM2_BUNDLED,
        bundled_model_path,
        load_model_info,
        load_tokenizer,
    )

    path = str(bundled_model_path(SMOLLM2_BUNDLED))  # FileNotFoundError (a failure) when it is not installed
    info = load_model_info(path)
    assert info.architecture == "llama"
    return info, load_weights(path), load_tokenizer(path)


def encode(info, tok, text: str) -> list[int]:
    return ([info.bos_token_id] if info.add_bos else []) + tok.encode(text, add_special_tokens=False).ids


def greedy(engine, info, tok, n: int) -> list[list[int]]:
    from workers.protocol import GenerateRequest, SamplingParams

    outs = {str(i): [] for i in range(len(PROMPTS))}
    for i, text in enumerate(PROMPTS):
        engine.add(GenerateRequest(request_id=str(i), prompt_ids=encode(info, tok, text), max_tokens=n,
                                   sampling=SamplingParams(temperature=0.0), ignore_eos=True))
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id] += o.token_ids
    return [outs[str(i)] for i in range(len(PROMPTS))]


def test_real_model_greedy_matches_llamacpp(smollm2, tmp_path):
    """The GPU engine's first N_MATCH greedy tokens against llama-server's on the same file (prompt as ids)."""
    import asyncio
    import json
    import urllib.request

    from tests.integration.llama_server_helpers import llama_server_binary
    from workers.cupy.gpu import create_gpu_engine
    from workers.llama_server.flags import server_argv, supported_flags
    from workers.llama_server.process import LlamaServerProcess

    info, weights, tok = smollm2
    binary = llama_server_binary()  # a skip where it is not built (a failure under CI / PULSE_REQUIRE_LLAMA_SERVER)
    engine = create_gpu_engine(info, weights, block_size=BS, num_blocks=512, max_num_seqs=8, max_step_tokens=1024,
                               context_length=2048)
    ours = greedy(engine, info, tok, N_MATCH)
    flags = supported_flags(binary)
    proc = LlamaServerProcess(lambda port: server_argv(binary, flags, model=info.path, port=port, slots=1,
                                                       kv_tokens=2048, profile_args=[]),
                              name="llama-gpu-parity", log_path=tmp_path / "llama-server.log")
    loop = asyncio.new_event_loop()
    loop.run_until_complete(proc.start())
    try:
        for text, mine in zip(PROMPTS, ours):
            body = {"prompt": encode(info, tok, text), "n_predict": N_MATCH, "temperature": 0.0, "top_k": 1,
                    "ignore_eos": True, "return_tokens": True, "cache_prompt": False, "stream": False,
                    "n_probs": 2}
            req = urllib.request.Request(proc.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answer = json.loads(r.read())
            theirs, probs = answer["tokens"], answer["completion_probabilities"]
            # llama-server's ignore_eos biases end-of-generation tokens to -inf, while the engine's
            # ignore_eos only keeps going past them: the two runs are the same computation only up to the
            # engine's first EOS (seen on the H200: "Paris." then EOS, where llama.cpp had to pick another)
            end = next((i for i, t in enumerate(mine) if t in info.eos_token_ids), len(mine))
            assert end >= 3, f"{text!r}: the engine ends after {end} tokens, too few to compare"
            # llama.cpp quantizes activations to 8 bits for its products with quantized weights (q8_1 on CUDA,
            # q8 on the CPU too), the engine does not: where llama.cpp's own top two are close the pick may
            # differ, and both runs go their own way from there. On this Q4_1 model "close" reaches ~0.4 nats:
            # on the H200 (0823fa8) "def fibonacci(n):" parted at token 4 where CUDA llama.cpp had the engine's
            # token second, 0.42 behind; on the CPU box llama.cpp's CPU build parted from the same engine at
            # gaps of 0.03 and 0.19 on two of these prompts, and llama.cpp's two builds disagree with each other
            # at that prompt's first token. Past 0.5 nats, or outside llama.cpp's top two, it is a fault.
            for i in range(end):
                if mine[i] == theirs[i]:
                    continue
                top = probs[i].get("top_logprobs") or probs[i].get("top_probs")
                gap = top[0]["logprob"] - top[1]["logprob"]
                assert mine[i] in (top[0]["id"], top[1]["id"]) and gap < 0.5, (
                    f"{text!r}: token {i}: GPU engine {mine} llama.cpp {theirs} (llama.cpp's top two {top[:2]})")
                assert i >= 3, f"{text!r}: only {i} tokens before a near-tie: GPU engine {mine} llama.cpp {theirs}"
                break
    finally:
        loop.run_until_complete(proc.stop())
        loop.close()


def test_real_model_greedy_matches_cpu(smollm2):
    from workers.cupy.engine import create_engine
    from workers.cupy.gpu import create_gpu_engine

    info, weights, tok = smollm2
    kw = {"block_size": BS, "num_blocks": 512, "max_num_seqs": 8, "max_step_tokens": 1024, "context_length": 2048}
    engines = {"cpu": create_engine(info, weights, np, **kw), "gpu": create_gpu_engine(info, weights, **kw)}
    assert type(engines["gpu"].model).__name__ == "GpuLlama"
    results = {name: greedy(eng, info, tok, N_TOKENS) for name, eng in engines.items()}
    for i in range(len(PROMPTS)):
        cpu, gpu = results["cpu"][i], results["gpu"][i]
        assert len(cpu) == len(gpu) == N_TOKENS
        # fp16 against fp32: the first N_MATCH agree (the llama.cpp parity criterion); later a near-tie may flip
        assert gpu[:N_MATCH] == cpu[:N_MATCH], f"prompt {i}: {gpu} vs {cpu}"

    cpu_m, gpu_m = engines["cpu"].model, engines["gpu"].model
    for text in PROMPTS:  # last-position logits of each prompt, one at a time
        ids = encode(info, tok, text)
        s = Sequence(request_id="x", token_ids=ids, max_tokens=1)
        blocks = BlockManager(64, BS)
        blocks.allocate(s, len(ids))
        c, g = step([cpu_m, gpu_m], [cpu_m.kv_storage(64, BS), gpu_kv(gpu_m, 64)], [(s, len(ids))])
        assert rel(g, c) < 2e-2
        assert float(np.sum(g * c) / np.linalg.norm(g) / np.linalg.norm(c)) > 0.999
