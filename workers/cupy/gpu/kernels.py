"""Launch wrappers for kernels.cu (compiled once per process by NVRTC through CuPy's RawModule).

Every wrapper launches on CuPy's current stream, so the same calls run eagerly or inside a CUDA graph
capture. Shapes follow the engine's flat step layout: T tokens, H hidden, activations in `act` dtype
(fp16 or bf16), residual stream and GEMM outputs in fp32.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import cupy as cp
import numpy as np

_SOURCE = Path(__file__).with_name("kernels.cu")
NORM_THREADS = 128
ARGMAX_THREADS = 1024
ARGMAX_CHUNK = 4096  # as in kernels.cu


def argmax_chunks(vocab: int) -> int:
    return -(-vocab // ARGMAX_CHUNK)


@lru_cache(maxsize=None)
def _module(head_dim: int, group: int, bf16: bool) -> cp.RawModule:
    options = ("-std=c++17", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", f"-DACT_BF16={int(bf16)}")
    return cp.RawModule(code=_SOURCE.read_text(), options=options)


class Kernels:
    """The compiled kernels for one model shape and activation dtype."""

    def __init__(self, head_dim: int = 256, group: int = 4, act: str = "float16"):
        if head_dim != 256:
            raise ValueError("the attention kernel is written for head_dim 256 (8 dims per lane, 16-byte loads)")
        if act not in ("float16", "bfloat16"):
            raise ValueError(f"activation dtype {act!r}: float16 or bfloat16")
        self.head_dim, self.group, self.act = head_dim, group, act
        mod = _module(head_dim, group, act == "bfloat16")
        self._f = {name: mod.get_function(name) for name in (
            "embed_norm", "add_norm", "qkv_post", "attention", "gelu_mul", "argmax_rows", "argmax_partial", "argmax_final", "prepare", "advance", "spin")}

    def embed_norm(self, tok, emb, scale: float, w, eps: float, resid, out):
        t, h = resid.shape
        self._f["embed_norm"]((t,), (NORM_THREADS,), (tok, emb, np.float32(scale), w, np.float32(eps),
                                                         np.int32(h), resid, out))

    def add_norm(self, resid, delta, w_post, w_next, eps: float, out, rows=None):
        """rows None: every row, resid updated; else only `rows` (int64), resid untouched."""
        h = resid.shape[1]
        n = out.shape[0]
        rows = rows if rows is not None else np.uint64(0)  # a null pointer
        self._f["add_norm"]((n,), (NORM_THREADS,), (resid, delta, w_post, w_next, rows, np.float32(eps),
                                                     np.int32(h), out), shared_mem=4 * h)

    def qkv_post(self, qkv, qn_w, kn_w, pos, slots, theta: float, pos_scale: float, eps: float,
                 n_heads: int, n_kv: int, q_out, k_cache, v_cache):
        t = qkv.shape[0]
        self._f["qkv_post"]((t,), (self.head_dim,), (
            qkv, qn_w, kn_w, pos, slots, np.float32(theta), np.float32(pos_scale), np.float32(eps),
            np.int32(n_heads), np.int32(n_kv), q_out, k_cache, v_cache))

    def attention(self, q, k_cache, v_cache, block_tables, tok_row, pos, block_size: int, window: int,
                  scale: float, n_kv: int, out):
        t = q.shape[0]
        self._f["attention"]((t, n_kv), (256,), (
            q, k_cache, v_cache, block_tables, np.int32(block_tables.shape[1]), tok_row, pos,
            np.int32(block_size), np.int32(window or 0), np.float32(scale), np.int32(n_kv), out))

    def gelu_mul(self, gate_up, out):
        t, f = out.shape
        n = t * f
        blocks = min((n + 255) // 256, 4096)
        self._f["gelu_mul"]((blocks,), (256,), (gate_up, np.int32(f), np.int64(n), out))

    def argmax_rows(self, logits, out, part_v=None, part_i=None):
        """First index of each row's maximum; two stages (ARGMAX_CHUNK logits per block) when scratch is given."""
        s, v = logits.shape
        if part_v is None or v % 4:
            self._f["argmax_rows"]((s,), (ARGMAX_THREADS,), (logits, np.int32(v), out))
            return
        n = argmax_chunks(v)
        self._f["argmax_partial"]((n, s), (256,), (logits, np.int32(v), part_v, part_i))
        self._f["argmax_final"]((s,), (32,), (part_v, part_i, np.int32(n), out))

    def spin(self, ns: int):
        self._f["spin"]((1,), (1,), (np.int64(ns),))

    def prepare(self, pos_in, block_tables, block_size: int, scratch_slot: int, pos, slots):
        n = pos.shape[0]
        self._f["prepare"](((n + 127) // 128,), (128,), (
            pos_in, block_tables, np.int32(block_tables.shape[1]), np.int32(block_size), np.int64(scratch_slot),
            np.int32(n), pos, slots))

    def advance(self, chosen, n_live: int, tok, pos_in):
        self._f["advance"](((n_live + 127) // 128,), (128,), (chosen, np.int32(n_live), tok, pos_in))
