"""Decode steps as CUDA graphs, one per batch size, replayed with one host-to-device copy per step.

A decode step is ~165 small launches; launched from Python that is ~5 us each, replayed from a graph well
under 2 us. Each graph is captured for G rows over fixed buffers (one shared workspace sized for the largest
G) and bound to one KV storage. A step of B <= G live sequences copies its positions and block tables into
the packed input (padding rows get position -1: the `prepare` kernel sends them to the scratch slot) and its
token ids into the token buffer, then replays the smallest graph that fits.

With a sliding-window pool (workers/cupy/kv_cache.py) the local layers' block tables ride in the same copy:
the graph of G rows reads them right after its G global rows (so the copy grows with G, not with the
largest graph), and a second `prepare` turns them into the local layers' KV slots.
"""
from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

from workers.cupy.gpu.gemma3 import Workspace


def capture(stream, step):
    """`step()` (launches only) as a CUDA graph on `stream`: run once eagerly first (module loads, cuBLAS
    heuristics), so nothing is loaded or allocated during the capture."""
    with stream:
        step()
        stream.synchronize()
        stream.begin_capture()
        try:
            step()
        finally:
            graph = stream.end_capture()
    stream.synchronize()
    return graph


class DecodeGraphs:
    def __init__(self, model, kv, block_size: int, sizes, max_blocks: int):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.sizes, self.max_blocks = tuple(sorted(sizes)), max_blocks
        g = self.sizes[-1]
        self.scratch_slot = kv.num_global * block_size  # the extra block kv_storage() added, per pool
        self.local_scratch_slot = kv.num_local * block_size
        self.two_pools = kv.two_pools
        self.ws = Workspace.allocate(model.cfg, g, g, model.act)
        # packed per-step input, one host-to-device copy a step: positions (g), token ids (g), then the block
        # tables (g x max_blocks), with two pools followed by the local tables (G rows after the graph's G
        # global rows); a pinned host mirror
        self.inp = cp.zeros(g * (2 + max_blocks * (2 if self.two_pools else 1)), cp.int32)
        # two pinned mirrors, alternating: with the engine's overlap (engine.py) a step is loaded while the copy of
        # the one before it may not have run yet; a mirror is written again two steps later, after the engine
        # read the step it went with
        self._hosts = [cp.cuda.alloc_pinned_memory(self.inp.nbytes) for _ in range(2)]
        self._views = [np.frombuffer(h, np.int32, self.inp.size) for h in self._hosts]
        for view in self._views:
            view[:] = 0  # pinned memory comes uninitialised: padding rows must read valid ids and blocks
        self._flip = 0
        self.host, self.host_view = self._hosts[0], self._views[0]
        self.tok = self.inp[g : 2 * g]
        self.pos = cp.zeros(g, cp.int32)
        self.slots = cp.zeros(g, cp.int64)
        self.local_slots = cp.zeros(g, cp.int64)
        self.local_pos = cp.zeros(g, cp.int32)  # the second prepare's positions: the same values, unused
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
        return self.inp[2 * big : 2 * big + big * self.max_blocks].reshape(big, self.max_blocks)[:g]

    def _local_tables(self, g: int):
        # right after the graph's own g global rows: a small graph's copy stays small. Rows past g of the
        # global tables may then hold another graph's local ids (and the reverse); only padding rows read
        # entries they were not given, and load() zeroes those
        base = 2 * self.sizes[-1] + g * self.max_blocks
        return self.inp[base : base + g * self.max_blocks].reshape(g, self.max_blocks)

    def _prepare(self, g: int):
        """Positions and KV slots of the step's rows; (slots, block tables) as GpuGemma3.run takes them."""
        k = self.model.kernels
        k.prepare(self._pos_in(g), self._tables(g), self.block_size, self.scratch_slot, self.pos[:g], self.slots[:g])
        if not self.two_pools:
            return self.slots[:g], self._tables(g)
        k.prepare(self._pos_in(g), self._local_tables(g), self.block_size, self.local_scratch_slot,
                  self.local_pos[:g], self.local_slots[:g])
        return (self.slots[:g], self.local_slots[:g]), (self._tables(g), self._local_tables(g))

    def _step(self, g: int) -> None:
        m, ws = self.model, self.ws.view(g, g)
        slots, tables = self._prepare(g)
        m.run(ws, self.tok[:g], self.pos[:g], slots, self.tok_row[:g], tables, self.rows[:g],
              self.kv, self.block_size, decode=True)

    def _capture(self, g: int):
        self.inp[:g] = -1  # every row padding while capturing and warming up: only the scratch slot is written
        return capture(self.stream, lambda: self._step(g))

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def local_tables_of(self, batch):
        """The step's sliding-window block tables when this storage has that pool (else None)."""
        if not self.two_pools:
            return None
        assert batch.local_meta is not None, "a two-pool KV storage needs the step's local block tables"
        return batch.local_meta.block_tables

    def load(self, token_ids, positions: np.ndarray, block_tables: np.ndarray, g: int,
             local_tables: np.ndarray | None = None) -> None:
        """Stage one step's inputs (host arrays; token ids may already be on the device) on the current stream."""
        n, width = block_tables.shape
        big = self.sizes[-1]
        self._flip ^= 1
        self.host, self.host_view = self._hosts[self._flip], self._views[self._flip]
        h = self.host_view
        h[:big] = -1
        h[:n] = positions
        on_device = isinstance(token_ids, cp.ndarray)
        h[big + n : 2 * big] = 0  # padding rows: any valid token id
        if not on_device:
            h[big : big + n] = token_ids
        tables = h[2 * big : 2 * big + big * self.max_blocks].reshape(big, self.max_blocks)
        tables[:n, :width] = block_tables
        # positions, tokens and the first g table rows only
        nbytes = 4 * (2 * big + g * self.max_blocks)
        if self.two_pools:
            base = 2 * big + g * self.max_blocks
            local = h[base : base + g * self.max_blocks].reshape(g, self.max_blocks)
            local[:n, :width] = local_tables
            tables[n:g] = 0  # padding rows read block 0 of each pool, never another graph's leftovers
            local[n:g] = 0
            nbytes = 4 * (base + g * self.max_blocks)
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
        self.load(batch.token_ids, meta.seq_lens - 1, meta.block_tables, g, self.local_tables_of(batch))
        self.replay(g)
        self.model.last_chosen = self.ws.chosen[:n]
        return self.ws.logits[:n]
