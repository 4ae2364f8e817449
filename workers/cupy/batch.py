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

import numpy as np

from workers.cupy.sequence import Sequence


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
                drafts: dict[int, list[int]] | None = None) -> StepBatch:
    """Inputs for running `n` new tokens of each (sequence, n); a sequence whose chunk reaches the end of
    its known tokens gets a logits row (its next token is sampled).

    `drafts` (speculation): {batch index: draft tokens} that follow that sequence's known tokens in this
    step; its last known token and every draft token then get a logits row (`n` counts the drafts too)."""
    # Per sequence only what needs its Python lists (tokens, table rows); positions and KV slots of every
    # token are computed once for the whole step (at 64 decoding sequences, per-sequence NumPy calls cost
    # more than the GPU's step).
    n_seq = len(scheduled)
    counts = np.fromiter((n for _, n in scheduled), np.int64, n_seq)
    starts = np.fromiter((seq.num_computed for seq, _ in scheduled), np.int64, n_seq)
    query_start = np.zeros(n_seq + 1, np.int32)
    np.cumsum(counts, out=query_start[1:])
    seq_lens = (starts + counts).astype(np.int32)
    lens = np.fromiter((len(seq.block_table) for seq, _ in scheduled), np.int64, n_seq)
    max_blocks = int(lens.max())
    tables = np.zeros((n_seq, max_blocks), np.int32)
    two_pools = any(seq.local_table for seq, _ in scheduled)
    local_raw = np.zeros((n_seq, max_blocks), np.int64) if two_pools else None
    tokens, logits_rows, sample_rows = [], [], []
    for b, (seq, n) in enumerate(scheduled):
        start = seq.num_computed
        draft = drafts.get(b, []) if drafts else []
        tokens += seq.token_ids[start : start + n - len(draft)]
        tokens += draft
        tables[b, : len(seq.block_table)] = seq.block_table
        if two_pools:
            local_raw[b, : len(seq.local_table)] = seq.local_table
        if start + n == len(seq.token_ids) + len(draft):
            last = int(query_start[b + 1])
            logits_rows += range(last - 1 - len(draft), last)
            sample_rows += [b] * (1 + len(draft))
    total = int(query_start[-1])
    row = np.repeat(np.arange(n_seq), counts)
    positions = np.repeat(starts - query_start[:-1], counts) + np.arange(total)
    block, offset = positions // block_size, positions % block_size
    assert (block < lens[row]).all(), "a token past its sequence's allocated blocks"
    slots = tables[row, block].astype(np.int64) * block_size + offset
    local = {}
    if two_pools:
        local_lens = np.fromiter((len(seq.local_table) for seq, _ in scheduled), np.int64, n_seq)
        assert (block < local_lens[row]).all(), "a token past its sequence's local blocks"
        written = local_raw[row, block]
        assert written.size == 0 or written.min() >= 0, "a local block the step writes was released"
        local_tables = np.maximum(local_raw, 0).astype(np.int32)
        local = {"local_slot_mapping": xp.asarray(written * block_size + offset),
                 "local_meta": AttentionMeta(query_start, seq_lens, local_tables, block_size)}
    meta = AttentionMeta(query_start, seq_lens, tables, block_size)
    return StepBatch(
        token_ids=xp.asarray(np.asarray(tokens, np.int32)),
        positions=xp.asarray(positions.astype(np.int32)),
        slot_mapping=xp.asarray(slots),
        logits_indices=xp.asarray(np.asarray(logits_rows, np.int64)),
        meta=meta,
        sample_rows=sample_rows,
        num_tokens=total,
        **local,
    )
