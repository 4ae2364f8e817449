"""Steps of per-token inputs as CUDA graphs, one per total token count, replayed with one host-to-device copy.

Two kinds of step replay these graphs. A speculative verify step runs each drafting sequence's last token and
its K drafts ([last, d1..dK] at consecutive positions) and wants logits at every one of those positions;
sequences without a draft in the same step run their one decode token. A mixed step carries short prompt
chunks (requests that just arrived) beside the decoding sequences and wants logits only where a sequence ends
its chunk or decodes. Eagerly either is ~165 launches from Python (~1.5 ms, more than the 0.8 ms a
graph-replayed decode step costs, and a new M for cuBLAS's heuristics every time): that ate most of what
speculation wins on a launch-bound GPU, and under load, where a request arrives every few steps, it made the
steps that admit them the engine thread's largest cost (BENCHMARKS.md, issue 25). Here a step of T tokens (any
mix of sequences, draft lengths and prompt chunks) replays the graph captured for the smallest size >= T: the
inputs are per token (id, position, KV slot, block-table row), and the rows whose logits the step wants are an
input too (every token for a verify step, one per sequence for a mixed step), so one graph serves every
layout. The graph computes logits for all of its G rows; a mixed step's unused rows cost one product's extra
rows, far less than the launches they replace. Every size takes cuBLAS's products: the fused small-batch ones
(gemma3.py's `small` path, made for decode rows) ran a verify step of up to 8 tokens slower, on an H100 at one
stream with K 4 (graphs of 8) 2,092-2,368 tok/s against 2,711-3,619 with cuBLAS, paired runs of the same code
edit (BENCHMARKS.md, issue 19, 2026-12-07); with K 8 (graphs of 16, cuBLAS either way) 4,988-5,081 against
4,317-6,041. Decode steps keep the fused products (the same comparison at 1-8 streams: no difference).

Padding tokens write their K/V to the scratch block (slot), sit at position 0 of table row 0 and produce
logits nobody reads. Every row's argmax (or in-step draw) is computed inside the graph (`chosen`), so
greedy acceptance copies T int32 to the host instead of gathering T x 262k logits.

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
        # one packed input, one copy a step: slots (int64, t per pool) and the rows whose logits the step wants
        # (int64, t), then positions, token ids and table rows per token (int32, t each), then the block tables
        # (max_rows x max_blocks int32 per pool)
        pools = len(self.scratch)
        self._i32_at = 2 * t * (pools + 1)  # int32 offset where the int32 part starts (after the int64 part)
        self._tables_at = self._i32_at + 3 * t
        n32 = self._tables_at + pools * max_rows * max_blocks
        self.inp = cp.zeros(n32, cp.int32)
        # two pinned mirrors, alternating (as graphs.DecodeGraphs'): with the engine's overlap a mixed step may be
        # loaded while the copy of the one before it has not run yet
        self._hosts = []
        for _ in range(2):
            mem = cp.cuda.alloc_pinned_memory(self.inp.nbytes)
            h32 = np.frombuffer(mem, np.int32, n32)
            h32[:] = 0
            self._hosts.append((mem, h32, h32[: self._i32_at].view(np.int64).reshape(pools + 1, t)))
        self._flip = 0
        self.slots = self.inp[: self._i32_at].view(cp.int64).reshape(pools + 1, t)
        self.rows = self.slots[pools]  # the logits rows: token indices, the wanted ones first
        self._all_rows = np.arange(t, dtype=np.int64)
        a = self._i32_at
        self.pos, self.tok, self.tok_row = self.inp[a : a + t], self.inp[a + t : a + 2 * t], self.inp[a + 2 * t : a + 3 * t]
        self.graphs: dict[int, cp.cuda.graph.Graph] = {}
        self.stream = cp.cuda.Stream(non_blocking=True)
        for self.host, self.h32, self.h64 in self._hosts:
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
        """Tokens from `start` on are padding: scratch slots, position 0, row 0, token 0; logits rows from `start`
        on are those tokens' own (nobody reads them)."""
        t = self.sizes[-1]
        a = self._i32_at
        for p, slot in enumerate(self.scratch):
            self.h64[p, start:t] = slot
        self.h64[len(self.scratch), start:t] = self._all_rows[start:t]
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
                       self.rows[:g], self.kv, self.block_size, decode=False, small=False)

    def _capture(self, g: int):
        return capture(self.stream, lambda: self._step(g))  # all padding while capturing

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def fits(self, batch) -> bool:
        """A step this object can replay: at least one token wants logits, within the captured sizes, rows and
        table width, with the storage's pools."""
        meta = batch.meta
        t = batch.num_tokens
        g = self.size_for(t)
        return (int(batch.logits_indices.shape[0]) > 0 and g is not None
                and meta.seq_lens.size <= self._rows(g) and meta.block_tables.shape[1] <= self.max_blocks
                and (batch.local_meta is not None) == self.two_pools)

    def run(self, batch):
        """Logits rows (S, vocab) of the step, for batch.logits_indices in their order (every token, in token
        order, for a verify step); `model.last_chosen` gets those rows' ids."""
        meta = batch.meta
        t, big = batch.num_tokens, self.sizes[-1]
        g = self.size_for(t)
        n_rows, width = meta.block_tables.shape
        self._flip ^= 1
        self.host, self.h32, self.h64 = self._hosts[self._flip]
        a, h = self._i32_at, self.h32
        s = int(batch.logits_indices.shape[0])
        self.h64[0, :t] = batch.slot_mapping
        h[a : a + t] = batch.positions
        on_device = isinstance(batch.token_ids, cp.ndarray)  # a step launched ahead: the draws not read yet
        h[a + big : a + big + t] = 0 if on_device else batch.token_ids
        h[a + 2 * big : a + 2 * big + t] = np.repeat(np.arange(n_rows, dtype=np.int32), np.diff(meta.query_start))
        self._pad_host(t)
        rows = self.h64[len(self.scratch)]  # from t on, _pad_host's
        rows[:s] = batch.logits_indices
        rows[s:t] = self._all_rows[s:t]
        views = self._table_views(h, g)
        views[0][:n_rows, :width] = meta.block_tables
        nbytes = 4 * (self._tables_at + n_rows * self.max_blocks)
        if self.two_pools:
            self.h64[1, :t] = batch.local_slot_mapping
            views[1][:n_rows, :width] = batch.local_meta.block_tables
            nbytes = 4 * (self._tables_at + (self._rows(g) + n_rows) * self.max_blocks)
        stream = cp.cuda.get_current_stream()
        self.inp.data.copy_from_host_async(ctypes.c_void_p(self.host.ptr), nbytes, stream)
        if on_device:
            self.tok[:t] = batch.token_ids
        self.graphs[g].launch(stream)
        self.model.last_chosen = self.ws.chosen[:s]
        return self.ws.logits[:s]
