"""Launch wrappers for kernels.cu (compiled once per process by NVRTC through CuPy's RawModule).

Every wrapper launches on CuPy's current stream, so the same calls run eagerly or inside a CUDA graph
capture. Shapes follow the engine's flat step layout: T tokens, H hidden, activations in `act` dtype
(fp16 or bf16), residual stream and GEMM outputs in fp32.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import cupy as cp
import numpy as np

_HERE = Path(__file__).parent
_SOURCES = ("common.cuh", "kernels.cu", "sampling.cu", "gemv.cu")  # one module; common.cuh first
NORM_THREADS = 128
ARGMAX_THREADS = 1024
ARGMAX_CHUNK = 4096  # as in sampling.cu
GEMV_MAX_M, GEMV_ROWS_PER_BLOCK = 8, 16  # as in gemv.cu
GEMV_PLAIN, GEMV_ADD_NORM, GEMV_GELU, GEMV_EMBED = 0, 1, 2, 3
MLP_F = 16  # as in gemv.cu
ATT_MAX_SPLIT = 8


# The attention kernel's settings, each overridden by PULSE_GPU_ATT_<NAME> (bench/attention_gpu.py times them side by
# side; workers/cupy/gpu/NOTES.md "The full batch" has the table that chose these defaults, 2026-12-04 on the H200):
# ASYNC 1: keys and values reach shared memory by cp.async in tiles, STAGES buffers of them (0: loads into registers,
#   few bytes in flight a block: 2.4x slower at 256 sequences x 512 tokens); UNROLL: keys a warp takes at once (a tile
#   is 8 x UNROLL keys); MIN_BLOCKS 2: registers capped at 128 so that two blocks share an SM; XRED 1: a warp's scores
#   summed in one many-value reduction (warp_sum_many); BLOCKS: the blocks a decode step's key splits aim for (two an
#   SM on the H200's 132; 128 before these defaults).
ATT_DEFAULTS = {"ASYNC": 1, "STAGES": 3, "UNROLL": 2, "MIN_BLOCKS": 2, "XRED": 1, "BLOCKS": 264}


@lru_cache(maxsize=1)
def attention_settings() -> dict[str, int]:
    """ATT_DEFAULTS with the environment's overrides, read once a process (cache_clear() to read them again)."""
    return {k: int(os.environ.get(f"PULSE_GPU_ATT_{k}", v)) for k, v in ATT_DEFAULTS.items()}


def attention_splits(n_tokens: int) -> int:
    """Key splits per decode token: enough blocks to fill the GPU's SMs (the BLOCKS setting) at small batches."""
    return max(1, min(ATT_MAX_SPLIT, attention_settings()["BLOCKS"] // max(n_tokens, 1)))


_NULL = np.uint64(0)


def argmax_chunks(vocab: int) -> int:
    return -(-vocab // ARGMAX_CHUNK)


@lru_cache(maxsize=None)
def _module(head_dim: int, group: int, bf16: bool) -> cp.RawModule:
    att = attention_settings()
    options = ("-std=c++17", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", f"-DACT_BF16={int(bf16)}",
               *(f"-DATT_{k}={att[k]}" for k in ("UNROLL", "MIN_BLOCKS", "XRED", "ASYNC", "STAGES")))
    code = "\n".join((_HERE / name).read_text() for name in _SOURCES)
    return cp.RawModule(code=code, options=options)


class Kernels:
    """The compiled kernels for one model shape and activation dtype.

    `pdl=True` on attention/gemv/mlp_fused launches them with programmatic dependent launch (pdl.py), for the
    small-batch decode chain when PULSE_GPU_PDL=1 (off by default: it measured no faster, NOTES.md)."""

    def __init__(self, head_dim: int = 256, group: int = 4, act: str = "float16"):
        if head_dim != 256:
            raise ValueError("the attention kernel is written for head_dim 256 (8 dims per lane, 16-byte loads)")
        if act not in ("float16", "bfloat16"):
            raise ValueError(f"activation dtype {act!r}: float16 or bfloat16")
        self.head_dim, self.group, self.act = head_dim, group, act
        self.att_settings = attention_settings()  # what the attention kernel was compiled with (the worker's stats)
        mod = _module(head_dim, group, act == "bfloat16")
        self._f = {name: mod.get_function(name) for name in (
            "embed_norm", "add_norm", "qkv_post", "attention", "gelu_mul", "argmax_rows", "argmax_partial", "argmax_final", "sample_partial", "sample_final", "prepare", "advance", "spin", "gemv", "mlp_fused")}
        # the norm modes stage 4 x M x K floats (80 KB at M=8, K=640): past the default 48 KB
        self._f["gemv"].max_dynamic_shared_size_bytes = 128 * 1024
        self._f["mlp_fused"].max_dynamic_shared_size_bytes = 128 * 1024
        self.use_pdl = os.environ.get("PULSE_GPU_PDL", "0") == "1"  # measured: no gain (NOTES.md)
        self.draws: DeviceDraws | None = None  # set by the engine's GpuSampler: the step's argmax samples

    def _launch(self, name: str, grid, block, args, shared_mem: int = 0, pdl: bool = False) -> None:
        if pdl and self.use_pdl:
            from workers.cupy.gpu.pdl import launch

            launch(self._f[name], grid, block, args, shared_mem)
        else:
            self._f[name](grid, block, args, shared_mem=shared_mem)

    def embed_norm(self, tok, emb, scale: float, w, eps: float, resid, out):
        t, h = resid.shape
        self._f["embed_norm"]((t,), (NORM_THREADS,), (tok, emb, np.float32(scale), w, np.float32(eps),
                                                         np.int32(h), resid, out))

    def add_norm(self, resid, delta, w_post, w_next, eps: float, out, rows=None):
        """rows None: every row, resid updated; else only `rows` (int64), resid untouched."""
        h = resid.shape[1]
        n = out.shape[0]
        rows = rows if rows is not None else _NULL
        self._f["add_norm"]((n,), (NORM_THREADS,), (resid, delta, w_post, w_next, rows, np.float32(eps),
                                                     np.int32(h), out), shared_mem=4 * h)

    def qkv_post(self, qkv, qn_w, kn_w, pos, slots, rope_cos, rope_sin, eps: float, n_heads: int, n_kv: int,
                 q_out, k_cache, v_cache):
        """rope_cos/rope_sin: (positions, head_dim/2) fp32 tables. One KV head (Gemma 3's layout)."""
        assert n_kv == 1 and n_heads == self.group
        t = qkv.shape[0]
        self._f["qkv_post"]((t,), (self.head_dim,), (
            qkv, qn_w, kn_w, pos, slots, rope_cos, rope_sin, np.float32(eps), np.int32(n_heads), np.int32(n_kv),
            q_out, k_cache, v_cache))

    def attention(self, q, k_cache, v_cache, block_tables, tok_row, pos, block_size: int, window: int,
                  scale: float, n_kv: int, out, fused=None, pdl: bool = False, n_split: int = 1, part=None,
                  counter=None):
        """fused: None, or (qkv, q_norm_w, k_norm_w, slots, rope_cos, rope_sin, eps) for a pure decode step, where
        the kernel does QK-norm, RoPE and the KV write itself (qkv_post is then not launched; q is unused).
        n_split > 1: keys split over that many blocks per token, merged by the last one;
        part (T, >= n_split, GROUP*HEAD_DIM + 2*GROUP) fp32 scratch and counter (T,) uint32, zero."""
        assert block_size >= 8, "the attention kernel stages a chunk's block-table entries for blocks >= 8 tokens"
        t = out.shape[0]
        if fused is None:
            extra = (_NULL, _NULL, _NULL, _NULL, _NULL, _NULL, np.float32(0))
        else:
            qkv, qn, kn, slots, rcos, rsin, eps = fused
            assert n_kv == 1
            extra = (qkv, qn, kn, slots, rcos, rsin, np.float32(eps))
        assert n_split == 1 or (part is not None and counter is not None)
        split = (np.int32(n_split), part if n_split > 1 else _NULL, counter if n_split > 1 else _NULL)
        self._launch("attention", (t, n_kv, n_split), (256,), (
            q if q is not None else _NULL, k_cache, v_cache, block_tables, np.int32(block_tables.shape[1]), tok_row,
            pos, np.int32(block_size), np.int32(window or 0), np.float32(scale), np.int32(n_kv), out) + extra + split,
            pdl=pdl)

    def gemv(self, mode: int, w, out, *, x_act=None, src=None, resid_in=None, resid_out=None, w_post=None,
             w_norm=None, tok=None, emb=None, emb_scale: float = 1.0, eps: float = 1e-6, zero=None,
             pdl: bool = False):
        """out[M, N] (fp32) = prologue(...)[M, K] @ w[N, K].T for M <= GEMV_MAX_M (see gemv.cu for the modes)."""
        m, n = out.shape
        k = w.shape[1]
        assert m <= GEMV_MAX_M and k % 8 == 0 and k <= 2048 and w.shape[0] == n
        smem = 4 * m * k * (4 if mode in (GEMV_ADD_NORM, GEMV_EMBED) else 1)

        def p(a):
            return _NULL if a is None else a

        self._launch("gemv", ((n + GEMV_ROWS_PER_BLOCK - 1) // GEMV_ROWS_PER_BLOCK,), (256,), (
            np.int32(mode), np.int32(m), np.int32(k), np.int32(n), w, p(x_act), p(src), p(resid_in), p(resid_out),
            p(w_post), p(w_norm), p(tok), p(emb), np.float32(emb_scale), np.float32(eps), out, p(zero),
            np.int32(0 if zero is None else zero.size)), shared_mem=smem, pdl=pdl)

    def mlp_fused(self, gate_up, down, o, resid_in, resid_out, w_post, w_norm, eps: float, out, pdl: bool = False):
        """out[M, H] += down @ (gelu(gate) * up)(rms(resid_in + rms(o) * w_post) * w_norm); out must be zero.
        resid_out gets the new residual. M <= GEMV_MAX_M, H <= 1024, F % 16 == 0 (see gemv.cu)."""
        m, h = out.shape
        f = down.shape[1]
        assert m <= GEMV_MAX_M and h <= 1024 and h % 32 == 0 and f % MLP_F == 0 and gate_up.shape == (2 * f, h)
        self._launch("mlp_fused", (f // MLP_F,), (256,), (
            np.int32(m), np.int32(h), np.int32(f), gate_up, down, o, resid_in, resid_out, w_post, w_norm,
            np.float32(eps), out), shared_mem=16 * m * h, pdl=pdl)

    def gelu_mul(self, gate_up, out):
        t, f = out.shape
        n = t * f
        blocks = min((n + 255) // 256, 4096)
        self._f["gelu_mul"]((blocks,), (256,), (gate_up, np.int32(f), np.int64(n), out))

    def argmax_rows(self, logits, out, part_v=None, part_i=None):
        """First index of each row's maximum; two stages (ARGMAX_CHUNK logits per block) when scratch is given.
        With `draws` set (and room for the rows) the choice is the sampler's: each row's draw under its
        parameters in `draws.params`, logprobs into `draws.logprob` (the step's graphs capture it so)."""
        s, v = logits.shape
        if part_v is None or v % 4:
            self._f["argmax_rows"]((s,), (ARGMAX_THREADS,), (logits, np.int32(v), out))
            return
        d = self.draws
        if d is not None and s <= d.rows and v == d.vocab:
            self.sample(logits, d.params[:s], out, d.logprob[:s], part_v, part_i, d.part_m, d.part_s)
            return
        n = argmax_chunks(v)
        self._f["argmax_partial"]((n, s), (256,), (logits, np.int32(v), part_v, part_i))
        self._f["argmax_final"]((s,), (32,), (part_v, part_i, np.int32(n), out))

    def sample(self, logits, params, out, logprob, part_v, part_i, part_m, part_s):
        """Per row of `logits`, the sampler's draw (sampling.cu): params (rows, 4) int32 as DeviceDraws
        packs them; out (rows,) int32 ids; logprob (rows,) fp32, written for rows that ask."""
        s, v = logits.shape
        n = argmax_chunks(v)
        assert v % 4 == 0 and min(part_v.shape[0], part_m.shape[0]) >= s and part_v.shape[1] == part_m.shape[1] == n
        self._f["sample_partial"]((n, s), (256,), (logits, np.int32(v), params, part_v, part_i, part_m, part_s))
        self._f["sample_final"]((s,), (32,), (part_v, part_i, np.int32(n), params, part_m, part_s, logits,
                                              np.int32(v), out, logprob))

    def spin(self, ns: int):
        self._f["spin"]((1,), (1,), (np.int64(ns),))

    def prepare(self, pos_in, block_tables, block_size: int, scratch_slot: int, pos, slots):
        n = pos.shape[0]
        self._f["prepare"](((n + 127) // 128,), (128,), (
            pos_in, block_tables, np.int32(block_tables.shape[1]), np.int32(block_size), np.int64(scratch_slot),
            np.int32(n), pos, slots))

    def advance(self, chosen, n_live: int, tok, pos_in):
        self._f["advance"](((n_live + 127) // 128,), (128,), (chosen, np.int32(n_live), tok, pos_in))


class DeviceDraws:
    """Per-row sampling parameters on the device for up to `rows` logits rows, read by every step's argmax
    (captured graphs included): key0, key1, 1/T as float bits, logprob wanted. Zeros mean greedy."""

    def __init__(self, rows: int, vocab: int):
        self.rows, self.vocab = rows, vocab
        self.params = cp.zeros((rows, 4), cp.int32)
        self.logprob = cp.zeros((rows,), cp.float32)
        self.part_m = cp.empty((rows, argmax_chunks(vocab)), cp.float32)
        self.part_s = cp.empty((rows, argmax_chunks(vocab)), cp.float32)
        # two pinned buffers, alternating: with the engine's overlap a step is staged while the one before it may
        # still wait for its copy to run
        self._hosts = [cp.cuda.alloc_pinned_memory(self.params.nbytes) for _ in range(2)]
        self._views = [np.frombuffer(h, np.int32, rows * 4).reshape(rows, 4) for h in self._hosts]
        self._flip = 0
        self.host = self._views[0]

    @staticmethod
    def pack(rows, out: np.ndarray) -> None:
        """Sampler rows (workers/cupy/sampler.SampleRow) into `out` (len(rows), 4) int32 (sampler.pack_rows)."""
        from workers.cupy.sampler import pack_rows

        pack_rows(rows, out)

    def load(self, rows) -> None:
        """Stage `rows` on the current stream; a pinned buffer is reused two stages later, after the engine read
        the step it went with."""
        n = len(rows)
        if not n:
            return
        self._flip ^= 1
        self.host = self._views[self._flip]
        self.pack(rows, self.host[:n])
        self.params[:n].data.copy_from_host_async(ctypes.c_void_p(self.host.ctypes.data), 16 * n,
                                                  cp.cuda.get_current_stream())
