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

With a sliding-window pool (workers/cupy/kv_cache.py) the local layers' slots and block tables ride in the
same copy: the graph of size G reads its R = min(G, max_rows) global table rows, then R local rows.
"""
from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

from workers.cupy.gpu.gemma3 import Workspace
from workers.cupy.gpu.graphs import capture


class VerifyGraphs:
    def __init__(self, model, kv, block_size: int, sizes, max_rows: int, max_blocks: int):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.sizes, self.max_rows, self.max_blocks = tuple(sorted(sizes)), max_rows, max_blocks
        self.two_pools = kv.two_pools
        t = self.sizes[-1]
        # the extra block kv_storage() added at the end of each pool
        self.scratch = (kv.num_global * block_size,) + ((kv.num_local * block_size,) if self.two_pools else ())
        self.ws = Workspace.allocate(model.cfg, t, t, model.act)
        # one packed input, one copy a step: slots (int64, t per pool), then positions, token ids and table
        # rows per token (int32, t each), then the block tables (max_rows x max_blocks int32 per pool)
        pools = len(self.scratch)
        self._i32_at = 2 * t * pools  # int32 offset where the int32 part starts (after the int64 slots)
        self._tables_at = self._i32_at + 3 * t
        n32 = self._tables_at + pools * max_rows * max_blocks
        self.inp = cp.zeros(n32, cp.int32)
        self.host = cp.cuda.alloc_pinned_memory(self.inp.nbytes)
        self.h32 = np.frombuffer(self.host, np.int32, n32)
        self.h32[:] = 0
        self.h64 = self.h32[: self._i32_at].view(np.int64).reshape(pools, t)
        self.slots = self.inp[: self._i32_at].view(cp.int64).reshape(pools, t)
        a = self._i32_at
        self.pos, self.tok, self.tok_row = self.inp[a : a + t], self.inp[a + t : a + 2 * t], self.inp[a + 2 * t : a + 3 * t]
        self.rows = cp.arange(t, dtype=cp.int64)
        self.graphs: dict[int, cp.cuda.graph.Graph] = {}
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._pad_host(0)  # every token padding while capturing: only the scratch blocks are written
        self.inp.data.copy_from_host(ctypes.c_void_p(self.host.ptr), self.inp.nbytes)
        for size in self.sizes:
            self.graphs[size] = self._capture(size)

    def _rows(self, g: int) -> int:
        return min(g, self.max_rows)

    def _table_views(self, buf, g: int) -> list:
        """The global (and local) block tables a graph of size g reads, as views of `buf` (device or host)."""
        r, mb, at = self._rows(g), self.max_blocks, self._tables_at
        return [buf[at + p * r * mb : at + (p + 1) * r * mb].reshape(r, mb) for p in range(len(self.scratch))]

    def _pad_host(self, start: int) -> None:
        """Tokens from `start` on are padding: scratch slots, position 0, row 0, token 0."""
        t = self.sizes[-1]
        a = self._i32_at
        for p, slot in enumerate(self.scratch):
            self.h64[p, start:t] = slot
        self.h32[a + start : a + t] = 0
        self.h32[a + t + start : a + 2 * t] = 0
        self.h32[a + 2 * t + start : a + 3 * t] = 0

    def _step(self, g: int) -> None:
        tables = self._table_views(self.inp, g)
        if self.two_pools:
            slots, tables = (self.slots[0, :g], self.slots[1, :g]), tuple(tables)
        else:
            slots, tables = self.slots[0, :g], tables[0]
        self.model.run(self.ws.view(g, g), self.tok[:g], self.pos[:g], slots, self.tok_row[:g], tables,
                       self.rows[:g], self.kv, self.block_size, decode=False, small=True)

    def _capture(self, g: int):
        return capture(self.stream, lambda: self._step(g))  # all padding while capturing

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def fits(self, batch) -> bool:
        """A step this object can replay: every token wants logits (a verify or pure decode step, rows in
        token order), within the captured sizes, rows and table width, with the storage's pools."""
        meta = batch.meta
        t = batch.num_tokens
        g = self.size_for(t)
        return (int(batch.logits_indices.shape[0]) == t and g is not None
                and meta.seq_lens.size <= self._rows(g) and meta.block_tables.shape[1] <= self.max_blocks
                and (batch.local_meta is not None) == self.two_pools)

    def run(self, batch):
        """Logits rows (T, vocab) of the step, in token order; `model.last_chosen` gets their argmax ids."""
        meta = batch.meta
        t, big = batch.num_tokens, self.sizes[-1]
        g = self.size_for(t)
        n_rows, width = meta.block_tables.shape
        a, h = self._i32_at, self.h32
        self.h64[0, :t] = batch.slot_mapping
        h[a : a + t] = batch.positions
        h[a + big : a + big + t] = batch.token_ids
        h[a + 2 * big : a + 2 * big + t] = np.repeat(np.arange(n_rows, dtype=np.int32), np.diff(meta.query_start))
        self._pad_host(t)
        views = self._table_views(h, g)
        views[0][:n_rows, :width] = meta.block_tables
        nbytes = 4 * (self._tables_at + n_rows * self.max_blocks)
        if self.two_pools:
            self.h64[1, :t] = batch.local_slot_mapping
            views[1][:n_rows, :width] = batch.local_meta.block_tables
            nbytes = 4 * (self._tables_at + (self._rows(g) + n_rows) * self.max_blocks)
        stream = cp.cuda.get_current_stream()
        self.inp.data.copy_from_host_async(ctypes.c_void_p(self.host.ptr), nbytes, stream)
        self.graphs[g].launch(stream)
        self.model.last_chosen = self.ws.chosen[:t]
        return self.ws.logits[:t]
