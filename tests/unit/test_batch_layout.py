"""build_batch (vectorised over the step's tokens) against a per-sequence reference, on random layouts:
prefill chunks, decode tokens and speculative drafts mixed, one or two KV pools (slid-out local blocks)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from workers.cupy import batch as batch_module
from workers.cupy.batch import build_batch
from workers.cupy.kv_cache import BlockTables
from workers.cupy.sequence import Sequence

BS = 4


def layout(rng: random.Random, two_pools: bool, decode: bool = False):
    """A random step; `decode`: a pure decode step (one token a sequence, no drafts: build_batch's fast path)."""
    scheduled, drafts = [], {}
    for b in range(rng.randint(1, 9)):
        length = rng.randint(1, 60)
        done = length - 1 if decode else rng.randint(0, length - 1)
        n = rng.randint(1, length - done)
        draft = []
        if done + n == length and rng.random() < 0.4 and not decode:
            draft = [rng.randint(0, 999) for _ in range(rng.randint(1, 4))]
            drafts[b] = draft
        seq = Sequence(request_id=str(b), token_ids=[rng.randint(0, 999) for _ in range(length)], max_tokens=8)
        seq.num_computed = done
        seq.block_table = [rng.randint(0, 500) for _ in range(-(-(done + n + len(draft)) // BS) + rng.randint(0, 2))]
        if two_pools:  # blocks wholly behind the step's first position may have slid out (-1)
            seq.local_table = [-1 if i < done // BS - rng.randint(1, 3) else rng.randint(0, 80)
                               for i in range(len(seq.block_table))]
        scheduled.append((seq, n + len(draft)))
    return scheduled, drafts


def reference(scheduled, drafts):
    """Token by token, the way the layout is defined."""
    tokens, positions, slots, local_slots, rows, sample = [], [], [], [], [], []
    for b, (seq, n) in enumerate(scheduled):
        draft = drafts.get(b, [])
        known = seq.token_ids[seq.num_computed : seq.num_computed + n - len(draft)]
        for i, tok in enumerate(known + draft):
            p = seq.num_computed + i
            tokens.append(tok)
            positions.append(p)
            slots.append(seq.block_table[p // BS] * BS + p % BS)
            if seq.local_table:
                local_slots.append(seq.local_table[p // BS] * BS + p % BS)
        if seq.num_computed + n == len(seq.token_ids) + len(draft):
            end = len(tokens)
            rows += range(end - 1 - len(draft), end)
            sample += [b] * (1 + len(draft))
    return tokens, positions, slots, local_slots, rows, sample


def with_tables(scheduled, two_pools: bool) -> BlockTables:
    """The engine's way to the block tables: each sequence's lists copied into a row of one array a pool."""
    tables = BlockTables(two_pools, rows=2, width=2)  # grown as the rows come
    for seq, _ in scheduled:
        tables.set_row(seq)
    return tables


@pytest.mark.parametrize("tables", [False, True])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("two_pools", [False, True])
def test_build_batch_matches_the_per_token_reference(two_pools, decode, tables):
    """With `tables` most steps (up to 8 sequences, 64 tokens) take _small_batch, the rest the vectorized path."""
    rng = random.Random(11 + two_pools + 2 * decode + 4 * tables)
    for _ in range(400):
        scheduled, drafts = layout(rng, two_pools, decode)
        batch = build_batch(scheduled, BS, np, drafts, with_tables(scheduled, two_pools) if tables else None)
        tokens, positions, slots, local_slots, rows, sample = reference(scheduled, drafts)
        assert batch.token_ids.tolist() == tokens and batch.token_ids.dtype == np.int32
        assert batch.positions.tolist() == positions and batch.positions.dtype == np.int32
        assert batch.slot_mapping.tolist() == slots and batch.slot_mapping.dtype == np.int64
        assert batch.logits_indices.tolist() == rows and batch.sample_rows == sample
        assert batch.num_tokens == len(tokens)
        for b, (seq, n) in enumerate(scheduled):
            assert batch.meta.block_tables[b, : len(seq.block_table)].tolist() == seq.block_table
            assert batch.meta.seq_lens[b] == seq.num_computed + n
        if two_pools:
            assert batch.local_slot_mapping.tolist() == local_slots
            assert batch.local_meta.block_tables.min() >= 0  # slid-out entries go to the kernels as block 0
        else:
            assert batch.local_meta is None and batch.local_slot_mapping is None


@pytest.mark.parametrize("two_pools", [False, True])
def test_small_steps_build_the_same_arrays_as_the_vectorized_path(two_pools, monkeypatch):
    rng, small = random.Random(5 + two_pools), 0
    for _ in range(300):
        scheduled, drafts = layout(rng, two_pools, decode=rng.random() < 0.3)
        tables = with_tables(scheduled, two_pools)
        monkeypatch.setattr(batch_module, "SMALL_SEQS", 8)
        a = build_batch(scheduled, BS, np, drafts, tables)
        monkeypatch.setattr(batch_module, "SMALL_SEQS", 0)  # every step vectorized
        b = build_batch(scheduled, BS, np, drafts, tables)
        small += len(scheduled) <= 8 and a.num_tokens <= batch_module.SMALL_TOKENS
        for name in ("token_ids", "positions", "slot_mapping", "logits_indices", "local_slot_mapping"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and x.tolist() == y.tolist()))
        assert a.sample_rows == b.sample_rows and a.num_tokens == b.num_tokens
        for meta_a, meta_b in ((a.meta, b.meta), (a.local_meta, b.local_meta)):
            assert (meta_a is None) == (meta_b is None)
            if meta_a is not None:
                for name in ("query_start", "seq_lens", "block_tables"):
                    x, y = getattr(meta_a, name), getattr(meta_b, name)
                    assert x.dtype == y.dtype and x.shape == y.shape and x.tolist() == y.tolist()
                assert meta_a.block_size == meta_b.block_size
    assert small > 100  # most of these layouts are small steps


def test_a_token_past_its_blocks_is_refused():
    seq = Sequence(request_id="x", token_ids=list(range(9)), max_tokens=4)
    seq.block_table = [3, 4]  # 8 slots for 9 tokens
    with pytest.raises(AssertionError):
        build_batch([(seq, 9)], BS, np)
    with pytest.raises(AssertionError):  # the small steps' path too
        build_batch([(seq, 9)], BS, np, tables=with_tables([(seq, 9)], False))
