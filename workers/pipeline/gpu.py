"""The GPU halves of a stage (workers/pipeline/layers.py has the NumPy ones): GpuGemma3's own kernels and
cuBLAS calls, over a slice of the layers (stage) or over none (the driver's embeddings and head).

Numerics follow the single-stage engine's general path step for step: the stage's entry norm is
`add_norm` with a zero delta (resid + 0 is exact), its exit finishes the last layer's residual add, and the
driver's head is the same fused norm, cuBLAS product, softcap and argmax. Activations cross stages as the
fp32 residual stream, as they are held inside one stage.
"""
from __future__ import annotations

import math

import cupy as cp
import numpy as np

from workers.cupy.gemma3 import Gemma3Config
from workers.cupy.gpu.gemma3 import GpuGemma3, Workspace, kv_dtype
from workers.cupy.batch import StepBatch
from workers.pipeline.layers import range_config, slice_weights


class GpuLayers:
    def __init__(self, cfg: Gemma3Config, weights: dict, lo: int, hi: int, act: str = "float16",
                 max_model_len: int = 8192):
        self.model = GpuGemma3(range_config(cfg, lo, hi), slice_weights(weights, lo, hi, cfg.hidden, False),
                               act=act, graph_sizes=(), max_model_len=max_model_len)
        self.kv, self.block_size = None, 0

    def alloc_kv(self, num_blocks: int, block_size: int) -> None:
        self.kv, self.block_size = self.model.kv_storage(num_blocks, block_size), block_size

    def run(self, x: np.ndarray, batch: StepBatch, last: bool) -> np.ndarray:
        m, meta = self.model, batch.meta
        k, blas, eps, L = m.kernels, m.blas, m.cfg.eps, m.layers
        n_query = np.diff(meta.query_start)
        decode = bool(np.all(n_query == 1))
        ws = Workspace.allocate(m.cfg, batch.num_tokens, 1, m.act)
        ws.resid[...] = cp.asarray(x)
        ws.down.fill(0)
        k.add_norm(ws.resid, ws.down, L[0]["post_ffn_norm"], L[0]["attn_norm"], eps, ws.x)  # x = norm(resid)
        pos = cp.asarray(batch.positions, cp.int32)
        slots = cp.asarray(batch.slot_mapping, cp.int64)
        tok_row = cp.asarray(np.repeat(np.arange(n_query.size, dtype=np.int32), n_query))
        tables = cp.asarray(np.ascontiguousarray(meta.block_tables, dtype=np.int32))
        for i, lw in enumerate(L):
            blas.linear(ws.x, lw["qkv"], ws.qkv)
            m._attention(i, lw, ws, pos, slots, tok_row, tables, self.kv, self.block_size, decode)
            blas.linear(ws.attn, lw["o"], ws.o)
            k.add_norm(ws.resid, ws.o, lw["post_attn_norm"], lw["ffn_norm"], eps, ws.x)
            blas.linear(ws.x, lw["gate_up"], ws.gate_up)
            k.gelu_mul(ws.gate_up, ws.mlp)
            blas.linear(ws.mlp, lw["down"], ws.down)
            # after the slice's last layer only the residual add matters (its norm output is unused)
            nxt = L[i + 1]["attn_norm"] if i + 1 < len(L) else lw["post_ffn_norm"]
            k.add_norm(ws.resid, ws.down, lw["post_ffn_norm"], nxt, eps, ws.x)
        out = ws.resid[cp.asarray(batch.logits_indices, cp.int64)] if last else ws.resid
        return cp.ascontiguousarray(out).get()


class GpuEnds:
    """The driver's part on a GPU: embeddings in, final norm + tied head + argmax out (GpuSampler reads
    `last_chosen` for all-greedy steps, as it does for the single-stage GpuGemma3)."""

    xp = np  # the engine builds step inputs on the host, as for GpuGemma3

    def __init__(self, cfg: Gemma3Config, weights: dict, act: str = "float16"):
        self.cfg = cfg
        self.model = GpuGemma3(range_config(cfg, 0, 0), slice_weights(weights, 0, 0, cfg.hidden, True), act=act,
                               graph_sizes=(), max_model_len=8)
        self.last_logits = self.last_chosen = None

    def embed_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        m, t = self.model, token_ids.shape[0]
        resid = cp.empty((t, self.cfg.hidden), cp.float32)
        scratch = cp.empty((t, self.cfg.hidden), kv_dtype(m.act))  # the normed copy: unused here
        m.kernels.embed_norm(cp.asarray(token_ids, cp.int32), m.embed, math.sqrt(self.cfg.hidden), m.out_norm,
                             self.cfg.eps, resid, scratch)
        return resid.get()

    def head(self, x_rows: np.ndarray):
        m, c = self.model, self.cfg
        s = x_rows.shape[0]
        ws = Workspace.allocate(c, 1, s, m.act)
        resid = cp.asarray(x_rows, cp.float32)
        zero = cp.zeros_like(resid)
        m.kernels.add_norm(resid, zero, m.out_norm, m.out_norm, c.eps, ws.x_out)  # resid + 0, then the final norm
        m.blas.linear(ws.x_out, m.embed, ws.logits)
        if c.final_softcap:
            cap = np.float32(c.final_softcap)
            ws.logits[...] = cp.tanh(ws.logits / cap) * cap
        m.kernels.argmax_rows(ws.logits, ws.chosen, ws.part_v, ws.part_i)
        self.last_logits, self.last_chosen = ws.logits, ws.chosen
        return ws.logits
