"""The flattened inputs of one engine step (the varlen layout paged-attention kernels expect).

Every scheduled sequence contributes a run of query tokens (a prefill chunk, one decode token, or later
K+1 positions to verify drafts); the runs are concatenated. Host (NumPy) copies of the attention metadata
stay for the NumPy ops and for kernel launch sizes; `xp` copies go to the device once per step.

With two KV pools (kv_cache.py) the sliding-window layers have their own block tables and slots
(`local_meta`, `local_slot_mapping`): the same logical layout, blocks of the local pool, and block 0 where
a block slid out of the window (never read: attention starts at the window).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from workers.cupy.sequence import Sequence

if TYPE_CHECKING:
    from workers.cupy.kv_cache import BlockTables

# a step of at most this many sequences and tokens is built per token in Python (_small_batch): below these the
# vectorized path's fixed cost of NumPy calls is most of its time
SMALL_SEQS = 8
SMALL_TOKENS = 64


@dataclass
class AttentionMeta:
    query_start: np.ndarray  # (B+1,) int32: sequence b's queries are rows query_start[b]:query_start[b+1]
    seq_lens: np.ndarray  # (B,) int32: context length after this step (its own new tokens included)
    block_tables: np.ndarray  # (B, max_blocks) int32, padded with 0
    block_size: int


@dataclass
class StepBatch:
    token_ids: object  # (T,) int32 on the device
    positions: object  # (T,) int32 on the device
    slot_mapping: object  # (T,) int64 on the device: where each token's K/V goes
    logits_indices: object  # (S,) int64 on the device: rows whose next-token logits are wanted
    meta: AttentionMeta
    sample_rows: list[int]  # for each logits row, the index of its sequence in the batch
    num_tokens: int
    local_slot_mapping: object = None  # (T,) int64: the sliding-window layers' slots (two pools), else None
    local_meta: AttentionMeta | None = None

    def kv_args(self, is_global: bool):
        """(slot mapping, attention metadata) for a layer of this kind."""
        if is_global or self.local_meta is None:
            return self.slot_mapping, self.meta
        return self.local_slot_mapping, self.local_meta


def build_batch(scheduled: list[tuple[Sequence, int]], block_size: int, xp,
                drafts: dict[int, list[int]] | None = None, tables: BlockTables | None = None) -> StepBatch:
    """Inputs for running `n` new tokens of each (sequence, n); a sequence whose chunk reaches the end of
    its known tokens gets a logits row (its next token is sampled).

    `drafts` (speculation): {batch index: draft tokens} that follow that sequence's known tokens in this
    step; its last known token and every draft token then get a logits row (`n` counts the drafts too).
    `tables`: the BlockManager's BlockTables holding every scheduled sequence's row (the engine's steps), so
    the block tables are one gather; without it (or for a sequence without a row) the lists are flattened."""
    # No NumPy call per sequence: the block tables are gathered from `tables` (or, without it, the lists are
    # chained and scattered in one go, as the step's tokens are), and positions and KV slots of every token
    # are computed once for the whole step (at 64 decoding sequences, per-sequence NumPy calls cost more than
    # the GPU's step; a per-sequence table copy was ~3/4 of this function's ~430 us at 64 sequences on the
    # dev box).
    n_seq = len(scheduled)
    seqs = [seq for seq, _ in scheduled]
    if tables is not None and n_seq <= SMALL_SEQS:
        rows = [seq.table_row for seq in seqs]
        if min(rows) >= 0 and sum(n for _, n in scheduled) <= SMALL_TOKENS:
            return _small_batch(scheduled, block_size, xp, drafts, tables, rows)
    counts = np.fromiter((n for _, n in scheduled), np.int64, n_seq)
    starts = np.fromiter((seq.num_computed for seq in seqs), np.int64, n_seq)
    known = np.fromiter((len(seq.token_ids) for seq in seqs), np.int64, n_seq)
    drafted = np.zeros(n_seq, np.int64)
    for b, draft in (drafts or {}).items():
        drafted[b] = len(draft)
    query_start = np.zeros(n_seq + 1, np.int32)
    np.cumsum(counts, out=query_start[1:])
    seq_lens = (starts + counts).astype(np.int32)
    rows = None if tables is None else np.fromiter((seq.table_row for seq in seqs), np.int64, n_seq)
    if rows is not None and rows.min() >= 0:
        lens = tables.lens[rows]
        max_blocks = int(lens.max())
        block_tables = tables.glob[rows, :max_blocks]
        local_raw = None if tables.local is None else tables.local[rows, :max_blocks]
        local_lens = lens
    else:
        lens = np.fromiter((len(seq.block_table) for seq in seqs), np.int64, n_seq)
        max_blocks = int(lens.max())
        block_tables = _scatter_rows((seq.block_table for seq in seqs), lens, max_blocks, np.int32)
        local_raw = None
        if any(seq.local_table for seq in seqs):
            local_lens = np.fromiter((len(seq.local_table) for seq in seqs), np.int64, n_seq)
            local_raw = _scatter_rows((seq.local_table for seq in seqs), local_lens, max_blocks, np.int64)
    if not drafts and bool((counts == 1).all()):  # a pure decode step: each sequence's next known token
        tokens = [seq.token_ids[seq.num_computed] for seq in seqs]
    elif not drafts:  # decodes beside prompt chunks (under load, most steps admit a request): no per-row NumPy
        tokens = []
        take, extend = tokens.append, tokens.extend
        for seq, n in scheduled:
            if n == 1:
                take(seq.token_ids[seq.num_computed])
            else:
                start = seq.num_computed
                extend(seq.token_ids[start : start + n])
    else:
        tokens = []
        for b, (seq, n) in enumerate(scheduled):
            start = seq.num_computed
            tokens += seq.token_ids[start : start + n - len(drafts.get(b, ()))]
            if b in drafts:
                tokens += drafts[b]
    # a sequence whose chunk reaches the end of its known tokens (drafts included) gets logits rows: its last
    # known token's and each draft token's
    wanted = np.flatnonzero(starts + counts == known + drafted)
    width = 1 + drafted[wanted]
    first = np.repeat(query_start[wanted + 1] - width, width)
    logits_rows = first + np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width)
    sample_rows = np.repeat(wanted, width).tolist()
    total = int(query_start[-1])
    row = np.repeat(np.arange(n_seq), counts)
    positions = np.repeat(starts - query_start[:-1], counts) + np.arange(total)
    block, offset = positions // block_size, positions % block_size
    assert (block < lens[row]).all(), "a token past its sequence's allocated blocks"
    slots = block_tables[row, block].astype(np.int64) * block_size + offset
    local = {}
    if local_raw is not None:
        assert (block < local_lens[row]).all(), "a token past its sequence's local blocks"
        written = local_raw[row, block].astype(np.int64)
        assert written.size == 0 or written.min() >= 0, "a local block the step writes was released"
        local_tables = np.maximum(local_raw, 0).astype(np.int32)
        local = {"local_slot_mapping": xp.asarray(written * block_size + offset),
                 "local_meta": AttentionMeta(query_start, seq_lens, local_tables, block_size)}
    meta = AttentionMeta(query_start, seq_lens, block_tables, block_size)
    return StepBatch(
        token_ids=xp.asarray(np.asarray(tokens, np.int32)),
        positions=xp.asarray(positions.astype(np.int32)),
        slot_mapping=xp.asarray(slots),
        logits_indices=xp.asarray(logits_rows.astype(np.int64)),
        meta=meta,
        sample_rows=sample_rows,
        num_tokens=total,
        **local,
    )


def _small_batch(scheduled, block_size: int, xp, drafts, tables: BlockTables, rows: list[int]) -> StepBatch:
    """build_batch for a step of a few sequences and tokens (one stream's decode or verify step, a few streams'):
    the same arrays, built per token in Python. The vectorized path's ~25 NumPy calls cost more than its work
    there (~65 of a speculative step's ~290 us host time at one stream on the dev box); here a token costs a few
    list operations. Only with `tables` (the engine's steps): the block tables are still one gather."""
    idx = np.asarray(rows)
    lens = tables.lens[idx]
    max_blocks = int(lens.max())
    block_tables = tables.glob[idx, :max_blocks]
    local_raw = None if tables.local is None else tables.local[idx, :max_blocks]
    g_rows, l_rows, lens = block_tables.tolist(), None if local_raw is None else local_raw.tolist(), lens.tolist()
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    local_slots: list[int] = []
    logits_rows: list[int] = []
    sample_rows: list[int] = []
    query_start, seq_lens, q = [0], [], 0
    for b, (seq, n) in enumerate(scheduled):
        start, end = seq.num_computed, seq.num_computed + n
        draft = drafts.get(b) if drafts else None
        nd = len(draft) if draft else 0
        tokens += seq.token_ids[start : end - nd]
        if nd:
            tokens += draft
        table, count = g_rows[b], lens[b]
        local_table = l_rows[b] if l_rows is not None else None
        for p in range(start, end):
            block, offset = divmod(p, block_size)
            assert block < count, "a token past its sequence's allocated blocks"
            slots.append(table[block] * block_size + offset)
            if local_table is not None:
                assert local_table[block] >= 0, "a local block the step writes was released"
                local_slots.append(local_table[block] * block_size + offset)
        positions += range(start, end)
        # its chunk reaches the end of its known tokens (drafts included): its last known token's and each draft
        # token's logits rows
        if end == len(seq.token_ids) + nd:
            logits_rows += range(q + n - 1 - nd, q + n)
            sample_rows += [b] * (1 + nd)
        q += n
        query_start.append(q)
        seq_lens.append(end)
    query_start = np.asarray(query_start, np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    local = {}
    if local_raw is not None:
        local = {"local_slot_mapping": xp.asarray(np.asarray(local_slots, np.int64)),
                 "local_meta": AttentionMeta(query_start, seq_lens, np.maximum(local_raw, 0).astype(np.int32),
                                             block_size)}
    return StepBatch(
        token_ids=xp.asarray(np.asarray(tokens, np.int32)),
        positions=xp.asarray(np.asarray(positions, np.int32)),
        slot_mapping=xp.asarray(np.asarray(slots, np.int64)),
        logits_indices=xp.asarray(np.asarray(logits_rows, np.int64)),
        meta=AttentionMeta(query_start, seq_lens, block_tables, block_size),
        sample_rows=sample_rows,
        num_tokens=q,
        **local,
    )


def _scatter_rows(rows, lens: np.ndarray, width: int, dtype) -> np.ndarray:
    """(len(lens), width) array, row i holding the list `rows[i]` (of length lens[i]) then zeros: one
    fromiter over the chained lists and one scattered write."""
    out = np.zeros((lens.size, width), dtype)
    total = int(lens.sum())
    if total:
        r = np.repeat(np.arange(lens.size), lens)
        c = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        out[r, c] = np.fromiter(chain.from_iterable(rows), dtype, total)
    return out
