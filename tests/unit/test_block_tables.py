"""BlockTables (kv_cache.py): the NumPy rows BlockManager keeps beside each sequence's block lists, so an engine
step gathers the batch's tables instead of flattening the lists. Random workloads of prefix hits, chunked
prefills, decodes, rolled-back drafts and frees, one and two pools, past the rows' and columns' first sizes:
after every operation the rows equal the lists, and build_batch gives the same step from the rows as from
the lists."""
from __future__ import annotations

import random

import numpy as np
import pytest

from workers.cupy.batch import build_batch
from workers.cupy.kv_cache import BlockManager
from workers.cupy.sequence import Sequence

BS, WINDOW = 4, 16


def check_rows(blocks: BlockManager, live: list[Sequence]) -> None:
    t = blocks.tables
    held = [seq.table_row for seq in live if seq.table_row >= 0]
    assert len(set(held)) == len(held), "two sequences share a row"
    for seq in live:
        if seq.table_row < 0:
            assert not seq.block_table
            continue
        row, n = seq.table_row, len(seq.block_table)
        assert t.lens[row] == n
        assert t.glob[row, :n].tolist() == seq.block_table and not t.glob[row, n:].any()
        if t.local is not None:
            assert t.local[row, :n].tolist() == seq.local_table and not t.local[row, n:].any()
    free = set(t._free_rows)
    assert not free & set(held) and len(free) == len(t._free_rows)
    for row in free:
        assert t.lens[row] == 0 and not t.glob[row].any()


def same_step(blocks: BlockManager, scheduled) -> None:
    a = build_batch(scheduled, BS, np, tables=blocks.tables)
    b = build_batch(scheduled, BS, np)
    for name in ("token_ids", "positions", "slot_mapping", "logits_indices"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.meta.block_tables.dtype == b.meta.block_tables.dtype == np.int32
    assert np.array_equal(a.meta.block_tables, b.meta.block_tables)
    assert a.sample_rows == b.sample_rows and a.num_tokens == b.num_tokens
    if blocks.local is not None:
        assert np.array_equal(a.local_meta.block_tables, b.local_meta.block_tables)
        assert a.local_meta.block_tables.dtype == np.int32
        assert a.local_slot_mapping.tolist() == b.local_slot_mapping.tolist()
        assert a.local_slot_mapping.dtype == b.local_slot_mapping.dtype == np.int64
    else:
        assert a.local_meta is None and b.local_meta is None


@pytest.mark.parametrize("two_pools", [False, True])
def test_the_rows_follow_the_lists_and_give_the_same_step(two_pools):
    rng = random.Random(5 + two_pools)
    blocks = (BlockManager(4000, BS, num_local=1500, window=WINDOW) if two_pools else BlockManager(4000, BS))
    prefixes = [[rng.randint(0, 50) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    live: list[Sequence] = []
    n_made = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.12 or not live:  # a new request, often sharing a prefix with earlier ones
            shared = rng.choice(prefixes)[: rng.randint(1, 40)]
            prompt = shared + [rng.randint(0, 999) for _ in range(rng.randint(1, 30))]
            seq = Sequence(str(n_made), prompt, max_tokens=200)
            n_made += 1
            blocks.match_prefix(seq)
            live.append(seq)
        elif op < 0.2:  # finished or preempted
            seq = live.pop(rng.randrange(len(live)))
            blocks.free(seq)
            check_rows(blocks, [seq])
        elif op < 0.28:  # drafts given blocks, then rolled back past the known tokens (speculative.py)
            seq = rng.choice(live)
            drafted = seq.num_remaining + rng.randint(1, 9)
            if blocks.can_allocate(seq, drafted):
                blocks.allocate(seq, drafted)
                check_rows(blocks, live)
                blocks.truncate(seq, len(seq.token_ids))
        else:  # one step over a random subset: prefill chunks or one decode token each
            step = rng.sample(live, rng.randint(1, len(live)))
            scheduled = []
            for seq in step:
                if not seq.num_remaining:
                    seq.token_ids.append(rng.randint(0, 999))
                n = min(seq.num_remaining, rng.choice([1, 3, 8, 17]))
                if not blocks.can_allocate(seq, n):
                    continue
                blocks.allocate(seq, n)
                scheduled.append((seq, n))
            if scheduled:
                same_step(blocks, scheduled)
            for seq, n in scheduled:
                seq.num_computed += n
                blocks.commit_full_blocks(seq)
        check_rows(blocks, live)
    t = blocks.tables
    assert t.glob.shape[0] > 16 and t.glob.shape[1] > 32, "the run never grew the rows or the columns"
    for seq in live:
        blocks.free(seq)
    assert not t.lens.any() and not t.glob.any() and len(t._free_rows) == t.glob.shape[0]


def test_a_sequence_without_a_row_takes_the_lists_path():
    blocks = BlockManager(64, BS)
    a, b = Sequence("a", list(range(9)), max_tokens=4), Sequence("b", list(range(5)), max_tokens=4)
    blocks.match_prefix(a)
    blocks.allocate(a, a.num_remaining)
    b.block_table = [40, 41]  # set by hand, as the layout tests do: no row
    batch = build_batch([(a, a.num_remaining), (b, 5)], BS, np, tables=blocks.tables)
    assert batch.meta.block_tables.tolist() == [a.block_table, [40, 41, 0]]
