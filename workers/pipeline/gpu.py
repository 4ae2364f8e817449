"""The GPU halves of a stage (workers/pipeline/layers.py has the NumPy ones): GpuGemma3's own kernels and
cuBLAS calls, over a slice of the layers (stage) or over none (the driver's embeddings and head).

Decode steps replay CUDA graphs (StageGraphs), as the single-stage engine's do; other steps run eagerly.
Numerics follow the single-stage engine's general path step for step: the stage's entry norm is
`add_norm` with a zero delta (resid + 0 is exact), its exit finishes the last layer's residual add, and the
driver's head is the same fused norm, cuBLAS product, softcap and argmax. Activations cross stages as the
fp32 residual stream, as they are held inside one stage.
"""
from __future__ import annotations

import logging
import math

import cupy as cp
import numpy as np

from workers.cupy.gemma3 import Gemma3Config
from workers.cupy.gpu.gemma3 import GpuGemma3, Workspace, device_kv_args, kv_dtype
from workers.cupy.gpu.graphs import DecodeGraphs
from workers.cupy.batch import StepBatch
from workers.pipeline.layers import range_config, slice_weights

log = logging.getLogger(__name__)


class GpuLayers:
    def __init__(self, cfg: Gemma3Config, weights: dict, lo: int, hi: int, act: str = "float16",
                 max_model_len: int = 8192):
        self.model = GpuGemma3(range_config(cfg, lo, hi), slice_weights(weights, lo, hi, cfg.hidden, False),
                               act=act, graph_sizes=(), max_model_len=max_model_len)
        self.kv, self.block_size, self.graphs = None, 0, None
        self.device_out = False  # the output stays on the device (a CUDA IPC hop next: cuda_ipc.py)

    def alloc_kv(self, num_blocks: int, block_size: int, max_seqs: int = 0, num_local: int | None = None) -> None:
        self.kv, self.block_size = self.model.kv_storage(num_blocks, block_size, num_local=num_local), block_size
        self.graphs = None
        if max_seqs:  # decode steps as CUDA graphs, as the single-stage engine replays them
            sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s < max_seqs) + (max_seqs,)
            try:
                self.graphs = StageGraphs(self, sizes, -(-self.model.max_model_len // block_size))
            except Exception:  # a capture this CuPy/driver refuses: decode eagerly, slower but the same tokens
                log.exception("stage decode graphs not captured; decoding eagerly")

    def layer_loop(self, ws, zeros, pos, slots, tok_row, tables, decode: bool) -> None:
        """ws.resid holds the incoming residual stream; leaves the outgoing one there (launches only)."""
        m = self.model
        k, blas, eps, L = m.kernels, m.blas, m.cfg.eps, m.layers
        k.add_norm(ws.resid, zeros, L[0]["post_ffn_norm"], L[0]["attn_norm"], eps, ws.x)  # x = norm(resid + 0)
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

    def run(self, x, batch: StepBatch, last: bool):
        """The slice's output for `x` (host or device rows): a host array, or with `device_out` a device one
        (with graphs, a view of their workspace: valid until the next step is launched on this stream, and
        the IPC copy into the next hop's ring is launched before that)."""
        meta = batch.meta
        n_query = np.diff(meta.query_start)
        decode = bool(np.all(n_query == 1))
        if decode and self.graphs is not None:
            out = self.graphs.run_stage(x, batch)
            if out is not None:
                if self.device_out:
                    return out[cp.asarray(batch.logits_indices, cp.int64)] if last else out
                out = out.get()
                return out[batch.logits_indices] if last else out
        ws = Workspace.allocate(self.model.cfg, batch.num_tokens, 1, self.model.act)
        ws.resid[...] = cp.asarray(x)
        tok_row = cp.asarray(np.repeat(np.arange(n_query.size, dtype=np.int32), n_query))
        slots, tables = device_kv_args(batch)
        self.layer_loop(ws, cp.zeros_like(ws.resid), cp.asarray(batch.positions, cp.int32), slots, tok_row, tables,
                        decode)
        out = ws.resid[cp.asarray(batch.logits_indices, cp.int64)] if last else ws.resid
        out = cp.ascontiguousarray(out)
        return out if self.device_out else out.get()


class StageGraphs(DecodeGraphs):
    """A stage's decode steps as CUDA graphs: DecodeGraphs' packed inputs and `prepare` kernel (positions,
    KV slots, padding rows to the scratch slot), with the residual stream copied in instead of embedded."""

    def __init__(self, layers: GpuLayers, sizes, max_blocks: int):
        g, hidden = max(sizes), layers.model.cfg.hidden
        self.layers = layers
        self.x_in = cp.zeros((g, hidden), cp.float32)
        self.zeros = cp.zeros((g, hidden), cp.float32)
        self.loaded = None  # recorded after each step's input copy from the pinned host buffer
        super().__init__(layers.model, layers.kv, layers.block_size, sizes, max_blocks)

    def _step(self, g: int) -> None:
        ws = self.ws.view(g, g)
        slots, tables = self._prepare(g)
        ws.resid[...] = self.x_in[:g]
        self.layers.layer_loop(ws, self.zeros[:g], self.pos[:g], slots, self.tok_row[:g], tables, True)

    def run_stage(self, x, batch: StepBatch):
        """The step's output rows on the device (a view of the graphs' workspace), or None (no graph fits)."""
        meta = batch.meta
        n = int(meta.seq_lens.size)
        g = self.size_for(n)
        if g is None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        if self.loaded is not None:
            # `load` rewrites the pinned host buffer the previous step's copy reads; with the output kept on
            # the device (CUDA IPC) nothing else waits for that step, so wait here for its copy (not its work)
            self.loaded.synchronize()
        self.load(np.zeros(n, np.int32), meta.seq_lens - 1, meta.block_tables, g, self.local_tables_of(batch))
        if self.loaded is None:
            self.loaded = cp.cuda.Event(disable_timing=True)
        self.loaded.record()
        if isinstance(x, cp.ndarray):  # from a CUDA IPC hop: already on this device
            self.x_in[:n] = x
        else:
            self.x_in[:n].set(np.ascontiguousarray(x, np.float32))
        self.replay(g)
        return self.ws.resid[:n]


class GpuEnds:
    """The driver's part on a GPU: embeddings in, final norm + tied head + argmax out (GpuSampler reads
    `last_chosen` for all-greedy steps, as it does for the single-stage GpuGemma3)."""

    xp = np  # the engine builds step inputs on the host, as for GpuGemma3

    def __init__(self, cfg: Gemma3Config, weights: dict, act: str = "float16"):
        self.cfg = cfg
        self.model = GpuGemma3(range_config(cfg, 0, 0), slice_weights(weights, 0, 0, cfg.hidden, True), act=act,
                               graph_sizes=(), max_model_len=8)
        self.last_logits = self.last_chosen = None
        self._ws: dict[int, Workspace] = {}
        self.device_out = False  # embeddings stay on the device (a CUDA IPC hop to stage 0: cuda_ipc.py)

    def embed_tokens(self, token_ids: np.ndarray):
        m, t = self.model, token_ids.shape[0]
        resid = cp.empty((t, self.cfg.hidden), cp.float32)
        scratch = cp.empty((t, self.cfg.hidden), kv_dtype(m.act))  # the normed copy: unused here
        m.kernels.embed_norm(cp.asarray(token_ids, cp.int32), m.embed, math.sqrt(self.cfg.hidden), m.out_norm,
                             self.cfg.eps, resid, scratch)
        return resid if self.device_out else resid.get()

    def synchronize(self) -> None:
        cp.cuda.get_current_stream().synchronize()

    def head(self, x_rows):  # host rows, or device rows from a CUDA IPC hop
        m, c = self.model, self.cfg
        s = x_rows.shape[0]
        ws = self._ws.get(s)
        if ws is None:  # one workspace per row count, kept: allocating 17 arrays a step costs ~0.1 ms
            ws = self._ws[s] = Workspace.allocate(c, 1, s, m.act)
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
