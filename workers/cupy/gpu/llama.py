"""Llama-family models on a CUDA GPU: the forward pass of workers/cupy/llama.py from fused kernels and cuBLAS.

The same machine as the Gemma 3 GPU path (gemma3.py): fp16/bf16 weights, activations and KV cache, an fp32
residual stream and fp32 GEMM outputs, one workspace of fixed buffers, decode steps replayed as CUDA graphs
(graphs.py) and speculative verify steps too (verify.py), prefill chunks eager. Per layer 4 cuBLAS products
(q/k/v as one, o, gate/up as one, down) and 4 kernels: RoPE + KV write (llama.cu), the shared paged attention
(kernels.cu, GQA: grid over KV heads, GROUP query heads each), residual add + RMSNorm, silu * up.

Gemma's fused small-batch products (gemv.cu) fold its sandwich norms and gelu into the GEMVs; Llama has
neither, so every step takes the cuBLAS path. Attention keys are not split across blocks (the split scratch
is laid out for one KV head).
"""
from __future__ import annotations

from functools import cache

import cupy as cp
import numpy as np

from workers.cupy.gpu.cublas import Cublas
from workers.cupy.gpu.gemma3 import STEP_KINDS, GpuGemma3, Workspace, kv_dtype, to_device
from workers.cupy.gpu.kernels import _HERE, NORM_THREADS, Kernels
from workers.cupy.kv_cache import KVStorage
from workers.cupy.llama import LlamaConfig, unpermute_rope_rows

_SOURCES = ("common.cuh", "kernels.cu", "sampling.cu", "llama.cu")


@cache
def _module(head_dim: int, group: int, bf16: bool) -> cp.RawModule:
    options = ("-std=c++17", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", f"-DACT_BF16={int(bf16)}",
               "-DATT_UNROLL=4")
    return cp.RawModule(code="\n".join((_HERE / name).read_text() for name in _SOURCES), options=options)


class _Functions(dict):
    """Kernels of the module by name, looked up on first use: the shared wrappers (Kernels) reach whichever
    of kernels.cu / sampling.cu's functions they need (graph capture warms every one up before capturing)."""

    def __init__(self, module: cp.RawModule):
        super().__init__()
        self.module = module

    def __missing__(self, name: str):
        self[name] = self.module.get_function(name)
        return self[name]


class LlamaKernels(Kernels):
    """kernels.cu's shared kernels (embed_norm, attention, argmax, prepare) compiled for a Llama head shape,
    plus llama.cu's. The attention kernel reads LANE_DIMS = head_dim / 32 dims per lane: head_dim 64, 128, 256."""

    def __init__(self, head_dim: int, group: int, act: str = "float16"):
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {head_dim}: the attention kernel takes 64, 128 or 256")
        if not 1 <= group <= 8:
            raise ValueError(f"{group} query heads per KV head: the attention kernel takes 1 to 8 (one warp each)")
        if act not in ("float16", "bfloat16"):
            raise ValueError(f"activation dtype {act!r}: float16 or bfloat16")
        self.head_dim, self.group, self.act = head_dim, group, act
        self._f = _Functions(_module(head_dim, group, act == "bfloat16"))
        self.use_pdl = False
        self.draws = None  # as Kernels: the sampler's device draws, when it sets them

    def residual_norm(self, resid, delta, w, eps: float, out, rows=None):
        """resid += delta; out = rmsnorm(resid) * w. rows None: every row, resid updated; else only `rows`
        (int64) and resid untouched (the final norm)."""
        h = resid.shape[1]
        self._f["residual_norm"]((out.shape[0],), (NORM_THREADS,), (
            resid, delta, w, rows if rows is not None else np.uint64(0), np.float32(eps), np.int32(h), out),
            shared_mem=4 * h)

    def rope_qkv(self, qkv, pos, slots, rope_cos, rope_sin, n_heads: int, n_kv: int, q_out, k_cache, v_cache):
        t = qkv.shape[0]
        self._f["rope_qkv"]((t,), (256,), (qkv, pos, slots, rope_cos, rope_sin, np.int32(n_heads), np.int32(n_kv),
                                           q_out, k_cache, v_cache))

    def silu_mul(self, gate_up, out):
        t, f = out.shape
        n = t * f
        self._f["silu_mul"]((min((n + 255) // 256, 4096),), (256,), (gate_up, np.int32(f), np.int64(n), out))


class GpuLlama(GpuGemma3):
    """GpuGemma3's step machinery (forward, graphs, verify graphs) around Llama's layers."""

    architecture = "llama"
    xp = np

    def __init__(self, cfg: LlamaConfig, weights: dict, act: str = "float16", graph_sizes=(1, 2, 4, 8, 16, 32, 64),
                 max_model_len: int = 8192, verify_sizes=(4, 8, 16, 32, 64, 128, 256)):
        from workers.cupy.ops import Ops

        self.cfg, self.act, self.max_model_len = cfg, act, max_model_len
        freqs = weights.get("rope_freqs.weight")
        # the NumPy path's own tables (float64 angles rounded to fp32 once): both paths rotate by identical values
        cos, sin = Ops(np).rope_tables(np.arange(max_model_len), cfg.rope_base, cfg.head_dim, cfg.rope_scale,
                                       None if freqs is None else np.asarray(freqs, np.float64))
        self.rope = (cp.asarray(cos), cp.asarray(sin))
        self.kernels = LlamaKernels(cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, act)
        self.blas = Cublas(act)
        self.embed = to_device(weights["token_embd.weight"], act)
        head = weights.get("output.weight")
        self.head = self.embed if head is None else to_device(head, act)  # tied: no second copy
        self.out_norm = cp.asarray(weights["output_norm.weight"], cp.float32)
        self.layers = [self._layer_weights(weights, i) for i in range(cfg.n_layers)]
        self.graph_sizes = tuple(sorted(graph_sizes))
        self._graphs = None
        self.verify_sizes = tuple(sorted(verify_sizes))
        self._verify = None
        self.mixed_graphs = True
        self.step_kinds = dict.fromkeys(STEP_KINDS, 0)  # forwards by path (GpuGemma3.forward)

    def _layer_weights(self, w: dict, i: int) -> dict:
        p, act, c = f"blk.{i}.", self.act, self.cfg
        qkv = np.concatenate([unpermute_rope_rows(w[p + "attn_q.weight"], c.n_heads),
                              unpermute_rope_rows(w[p + "attn_k.weight"], c.n_kv_heads), w[p + "attn_v.weight"]])
        gate_up = np.concatenate([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
        return {
            "attn_norm": cp.asarray(w[p + "attn_norm.weight"], cp.float32), "qkv": to_device(qkv, act),
            "o": to_device(w[p + "attn_output.weight"], act),
            "ffn_norm": cp.asarray(w[p + "ffn_norm.weight"], cp.float32), "gate_up": to_device(gate_up, act),
            "down": to_device(w[p + "ffn_down.weight"], act),
        }

    def kv_storage(self, num_blocks: int, block_size: int, dtype: str | None = None,
                   num_local: int | None = None) -> KVStorage:
        """K/V arrays with one extra block at the end: the scratch block padding rows of a graph write to.
        One pool (no sliding-window layers)."""
        c = self.cfg
        return KVStorage(cp, c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, kv_dtype(self.act),
                         extra=1)

    def run(self, ws: Workspace, tok, pos, slots, tok_row, block_tables, logit_rows, kv: KVStorage,
            block_size: int, decode: bool = False, small: bool | None = None) -> None:
        """One forward pass into ws.logits / ws.chosen (greedy ids). Launches only: capturable as a graph.
        Any step (prefill, decode, verify): each layer writes its K/V before its attention reads them."""
        c, k, blas, eps, layers = self.cfg, self.kernels, self.blas, self.cfg.eps, self.layers
        assert not isinstance(block_tables, tuple), "one KV pool: slots and block tables are single arrays"
        rcos, rsin = self.rope
        k.embed_norm(tok, self.embed, 1.0, layers[0]["attn_norm"], eps, ws.resid, ws.x)
        for i, lw in enumerate(layers):
            blas.linear(ws.x, lw["qkv"], ws.qkv)
            k.rope_qkv(ws.qkv, pos, slots, rcos, rsin, c.n_heads, c.n_kv_heads, ws.q, kv.k[i], kv.v[i])
            k.attention(ws.q, kv.k[i], kv.v[i], block_tables, tok_row, pos, block_size, 0, c.query_scale,
                        c.n_kv_heads, ws.attn)
            blas.linear(ws.attn, lw["o"], ws.o)
            k.residual_norm(ws.resid, ws.o, lw["ffn_norm"], eps, ws.x)
            blas.linear(ws.x, lw["gate_up"], ws.gate_up)
            k.silu_mul(ws.gate_up, ws.mlp)
            blas.linear(ws.mlp, lw["down"], ws.down)
            if i + 1 < len(layers):
                k.residual_norm(ws.resid, ws.down, layers[i + 1]["attn_norm"], eps, ws.x)
        if logit_rows.shape[0] == 0:  # a prefill chunk short of its prompt's end: no logits (a 0-block launch fails)
            return
        k.residual_norm(ws.resid, ws.down, self.out_norm, eps, ws.x_out, rows=logit_rows)
        blas.linear(ws.x_out, self.head, ws.logits)
        k.argmax_rows(ws.logits, ws.chosen, ws.part_v, ws.part_i)
