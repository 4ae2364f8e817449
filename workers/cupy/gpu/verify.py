"""Speculative verify steps as CUDA graphs, one per total token count, replayed with one host-to-device copy.

A verify step runs each drafting sequence's last token and its K drafts ([last, d1..dK] at consecutive
positions) and wants logits at every one of those positions; sequences without a draft in the same step
run their one decode token. Eagerly that is ~165 launches from Python (~1.5 ms, more than the 0.8 ms a
graph-replayed decode step costs), which ate most of what speculation wins on a launch-bound GPU. Here a
step of T tokens (any mix of sequences and draft lengths) replays the graph captured for the smallest
size >= T: the inputs are per token (id, position, KV slot, block-table row), so one graph serves every
layout. Up to GEMV_MAX_M tokens take the fused small-batch products; larger sizes take cuBLAS.

Padding tokens write their K/V to the scratch block (slot), sit at position 0 of table row 0 and produce
logits nobody reads. Every token's argmax is computed inside the graph (`chosen`), so greedy acceptance
copies T int32 to the host instead of gathering T x 262k logits.
"""
from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

from workers.cupy.gpu.gemma3 import Workspace


class VerifyGraphs:
    def __init__(self, model, kv, block_size: int, sizes, max_rows: int, max_blocks: int):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.sizes, self.max_rows, self.max_blocks = tuple(sorted(sizes)), max_rows, max_blocks
        t = self.sizes[-1]
        self.scratch_slot = (kv.k.shape[1] - 1) * block_size  # the extra block kv_storage() added
        self.ws = Workspace.allocate(model.cfg, t, t, model.act)
        # one packed input, one copy a step: slots (int64, t), then positions, token ids and table rows per
        # token (int32, t each), then the block tables (max_rows x max_blocks int32)
        self._i32_at = 2 * t  # int32 offset where the int32 part starts (after the int64 slots)
        self._tables_at = self._i32_at + 3 * t
        n32 = self._tables_at + max_rows * max_blocks
        self.inp = cp.zeros(n32, cp.int32)
        self.host = cp.cuda.alloc_pinned_memory(self.inp.nbytes)
        self.h32 = np.frombuffer(self.host, np.int32, n32)
        self.h32[:] = 0
        self.h64 = self.h32[: self._i32_at].view(np.int64)
        self.slots = self.inp[: self._i32_at].view(cp.int64)
        a = self._i32_at
        self.pos, self.tok, self.tok_row = self.inp[a : a + t], self.inp[a + t : a + 2 * t], self.inp[a + 2 * t : a + 3 * t]
        self.tables = self.inp[self._tables_at :].reshape(max_rows, max_blocks)
        self.rows = cp.arange(t, dtype=cp.int64)
        self.graphs: dict[int, cp.cuda.graph.Graph] = {}
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._pad_host(0)  # every token padding while capturing: only the scratch block is written
        self.inp.data.copy_from_host(ctypes.c_void_p(self.host.ptr), self.inp.nbytes)
        for size in self.sizes:
            self.graphs[size] = self._capture(size)

    def _pad_host(self, start: int) -> None:
        """Tokens from `start` on are padding: scratch slot, position 0, row 0, token 0."""
        t = self.sizes[-1]
        a = self._i32_at
        self.h64[start:t] = self.scratch_slot
        self.h32[a + start : a + t] = 0
        self.h32[a + t + start : a + 2 * t] = 0
        self.h32[a + 2 * t + start : a + 3 * t] = 0

    def _step(self, g: int) -> None:
        m = self.model
        m.run(self.ws.view(g, g), self.tok[:g], self.pos[:g], self.slots[:g], self.tok_row[:g], self.tables,
              self.rows[:g], self.kv, self.block_size, decode=False, small=True)

    def _capture(self, g: int):
        with self.stream:
            self._step(g)  # once eagerly (all padding): module loads, cuBLAS heuristics, no allocation in capture
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

    def fits(self, batch) -> bool:
        """A step this object can replay: every token wants logits (a verify or pure decode step, rows in
        token order), within the captured sizes, rows and table width."""
        meta = batch.meta
        t = batch.num_tokens
        return (int(batch.logits_indices.shape[0]) == t and self.size_for(t) is not None
                and meta.seq_lens.size <= self.max_rows and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch):
        """Logits rows (T, vocab) of the step, in token order; `model.last_chosen` gets their argmax ids."""
        meta = batch.meta
        t = batch.num_tokens
        g = self.size_for(t)
        n_rows, width = meta.block_tables.shape
        a, h = self._i32_at, self.h32
        self.h64[:t] = batch.slot_mapping
        h[a : a + t] = batch.positions
        h[a + self.sizes[-1] : a + self.sizes[-1] + t] = batch.token_ids
        h[a + 2 * self.sizes[-1] : a + 2 * self.sizes[-1] + t] = np.repeat(
            np.arange(n_rows, dtype=np.int32), np.diff(meta.query_start))
        self._pad_host(t)
        tables = h[self._tables_at :].reshape(self.max_rows, self.max_blocks)
        tables[:n_rows, :width] = meta.block_tables
        nbytes = 4 * (self._tables_at + n_rows * self.max_blocks)
        stream = cp.cuda.get_current_stream()
        self.inp.data.copy_from_host_async(ctypes.c_void_p(self.host.ptr), nbytes, stream)
        self.graphs[g].launch(stream)
        self.model.last_chosen = self.ws.chosen[:t]
        return self.ws.logits[:t]
