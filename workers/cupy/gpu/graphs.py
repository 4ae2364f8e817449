"""Decode steps as CUDA graphs, one per batch size, replayed with one host-to-device copy per step.

A decode step is ~165 small launches; launched from Python that is ~5 us each, replayed from a graph well
under 2 us. Each graph is captured for G rows over fixed buffers (one shared workspace sized for the largest
G) and bound to one KV storage. A step of B <= G live sequences copies its positions and block tables into
the packed input (padding rows get position -1: the `prepare` kernel sends them to the scratch slot) and its
token ids into the token buffer, then replays the smallest graph that fits.
"""
from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

from workers.cupy.gpu.gemma3 import Workspace


class DecodeGraphs:
    def __init__(self, model, kv, block_size: int, sizes, max_blocks: int):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.sizes, self.max_blocks = tuple(sorted(sizes)), max_blocks
        g = self.sizes[-1]
        self.scratch_slot = (kv.k.shape[1] - 1) * block_size  # the extra block kv_storage() added
        self.ws = Workspace.allocate(model.cfg, g, g, model.act)
        # packed per-step input, one host-to-device copy a step: positions (g), token ids (g), then the block
        # tables (g x max_blocks); a pinned host mirror
        self.inp = cp.zeros(g * (2 + max_blocks), cp.int32)
        self.host = cp.cuda.alloc_pinned_memory(self.inp.nbytes)
        self.host_view = np.frombuffer(self.host, np.int32, self.inp.size)
        self.host_view[:] = 0  # pinned memory comes uninitialised: padding rows must read valid ids and blocks
        self.tok = self.inp[g : 2 * g]
        self.pos = cp.zeros(g, cp.int32)
        self.slots = cp.zeros(g, cp.int64)
        self.tok_row = cp.arange(g, dtype=cp.int32)
        self.rows = cp.arange(g, dtype=cp.int64)
        self.out_host = cp.cuda.alloc_pinned_memory(4 * g)
        self.graphs: dict[int, cp.cuda.graph.Graph] = {}
        self.stream = cp.cuda.Stream(non_blocking=True)
        for size in self.sizes:
            self.graphs[size] = self._capture(size)

    def _pos_in(self, g: int):
        return self.inp[:g]

    def _tables(self, g: int):
        # rows of the packed tables keep their full width so a graph of any size indexes them the same way
        big = self.sizes[-1]
        return self.inp[2 * big :].reshape(big, self.max_blocks)[:g]

    def _step(self, g: int) -> None:
        m, ws = self.model, self.ws.view(g, g)
        m.kernels.prepare(self._pos_in(g), self._tables(g), self.block_size, self.scratch_slot,
                          self.pos[:g], self.slots[:g])
        m.run(ws, self.tok[:g], self.pos[:g], self.slots[:g], self.tok_row[:g], self._tables(g), self.rows[:g],
              self.kv, self.block_size, decode=True)

    def _capture(self, g: int):
        self.inp[:g] = -1  # every row padding while capturing and warming up: only the scratch slot is written
        with self.stream:
            self._step(g)  # once eagerly: module loads, cuBLAS heuristics, nothing allocated during capture
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                self._step(g)
            finally:
                graph = self.stream.end_capture()
        self.stream.synchronize()
        return graph

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def load(self, token_ids, positions: np.ndarray, block_tables: np.ndarray, g: int) -> None:
        """Stage one step's inputs (host arrays; token ids may already be on the device) on the current stream."""
        n, width = block_tables.shape
        big = self.sizes[-1]
        h = self.host_view
        h[:big] = -1
        h[:n] = positions
        on_device = isinstance(token_ids, cp.ndarray)
        h[big + n : 2 * big] = 0  # padding rows: any valid token id
        if not on_device:
            h[big : big + n] = token_ids
        tables = h[2 * big :].reshape(big, self.max_blocks)
        tables[:n, :width] = block_tables
        # positions, tokens and the first g table rows only; the host buffer is reused next step, after the
        # engine's own synchronisation on the sampled ids
        nbytes = 4 * (2 * big + g * self.max_blocks)
        self.inp.data.copy_from_host_async(ctypes.c_void_p(self.host.ptr), nbytes, cp.cuda.get_current_stream())
        if on_device:
            self.tok[:n] = token_ids

    def replay(self, g: int) -> None:
        self.graphs[g].launch(cp.cuda.get_current_stream())

    def run(self, batch):
        """Logits rows (B, vocab) of a pure decode step; the engine samples from them before the next step."""
        meta = batch.meta
        n = int(meta.seq_lens.size)
        g = self.size_for(n)
        if g is None or meta.block_tables.shape[1] > self.max_blocks:
            return self.model.forward_eager(batch, self.kv)
        self.load(batch.token_ids, meta.seq_lens - 1, meta.block_tables, g)
        self.replay(g)
        self.model.last_chosen = self.ws.chosen[:n]
        return self.ws.logits[:n]
