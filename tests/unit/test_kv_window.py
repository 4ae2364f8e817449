"""The sliding-window pool (kv_cache.py, two pools): local blocks bounded by the window, prefix hits that
need the window's local blocks, events from the global pool, rollback and preemption under local pressure."""
from workers.cupy.kv_cache import BlockManager, plan_pools
from workers.cupy.scheduler import Scheduler
from workers.cupy.sequence import Sequence, SeqStatus

BS, WINDOW = 4, 16  # a query reads its own position and the 15 before it: at most 5 blocks, plus one written
GEMMA = [(i + 1) % 6 == 0 for i in range(18)]  # Gemma 3 270M: layers 5, 11, 17 global


def two_pools(num_blocks=200, num_local=40, sink=None) -> BlockManager:
    return BlockManager(num_blocks, BS, sink, num_local=num_local, window=WINDOW)


def compute(blocks: BlockManager, seq: Sequence, n: int) -> None:
    """One engine step of `n` tokens for `seq` (allocate, 'run', register)."""
    assert blocks.can_allocate(seq, n)
    blocks.allocate(seq, n)
    seq.num_computed += n
    blocks.commit_full_blocks(seq)


def prefill_and_decode(blocks: BlockManager, seq: Sequence, chunk: int, decode: int) -> list[int]:
    """Prefill in chunks, then decode `decode` tokens; the local blocks held after each step."""
    held = []
    blocks.match_prefix(seq)
    while seq.num_remaining:
        compute(blocks, seq, min(chunk, seq.num_remaining))
        held.append(sum(b >= 0 for b in seq.local_table))
    for i in range(decode):
        seq.token_ids.append(1000 + i)
        compute(blocks, seq, 1)
        held.append(sum(b >= 0 for b in seq.local_table))
    return held


def test_the_budget_is_split_at_equal_bytes_and_small_budgets_keep_one_size():
    plan = plan_pools(2048, 16, GEMMA, 512, max_num_seqs=8, max_step_tokens=2048)
    # the running batch's windows and chunk, plus a third of the rest for finished sequences' windows
    running = 8 * (32 + 3) + 128
    assert plan.num_local == running + (2048 - running) // 3 and plan.window == 512
    layer_blocks = plan.num_global * 3 + plan.num_local * 15
    assert 2048 * 18 - 3 < layer_blocks <= 2048 * 18  # the same bytes as 2048 blocks of all 18 layers
    assert plan.num_global * 16 > 3.5 * 2048 * 16  # over 3.5x the context tokens in the same memory
    # a larger budget: finished windows are not capped at max_num_seqs (the H200 routing replay's sizes:
    # 8 windows were fewer than two agent conversations' turn ends)
    big = plan_pools(3000, 16, GEMMA, 512, max_num_seqs=8, max_step_tokens=2048)
    assert (big.num_global, big.num_local) == (11640, 408 + 864)
    assert (big.num_local - running) // 33 == 26 > 8  # finished windows of 33 blocks (window + 1)
    small = plan_pools(128, 16, GEMMA, 512, max_num_seqs=4, max_step_tokens=2048)
    assert (small.num_global, small.num_local) == (128, 128)  # the batch's windows would not fit in less
    assert plan_pools(2048, 16, GEMMA, 512, 8, 2048, enabled=False).num_local is None
    assert plan_pools(2048, 16, [True] * 4, None, 8, 2048).window is None  # no sliding-window layers


def test_local_blocks_stay_bounded_by_the_window_while_global_ones_grow():
    blocks = two_pools()
    seq = Sequence("s", list(range(30)), max_tokens=400)
    held = prefill_and_decode(blocks, seq, chunk=8, decode=300)
    assert max(held[4:]) <= WINDOW // BS + 2  # decode: the window's blocks plus the one being written
    assert blocks.num_used == -(-330 // BS) == len(seq.block_table)  # global: the whole context
    assert blocks.num_local_used == held[-1] <= WINDOW // BS + 2
    first = blocks.first_needed(seq.num_computed)
    assert all(b == -1 for b in seq.local_table[:first]) and all(b >= 0 for b in seq.local_table[first:])
    blocks.free(seq)
    assert blocks.num_used == 0 and blocks.num_local_used == 0


def test_a_prefix_hit_past_the_window_attaches_global_blocks_and_the_local_window():
    blocks = two_pools()
    a = Sequence("a", list(range(40)), max_tokens=1)
    prefill_and_decode(blocks, a, chunk=4, decode=0)
    a_global, a_local = list(a.block_table), list(a.local_table)
    blocks.free(a)
    b = Sequence("b", list(range(40)) + [99, 98, 97], max_tokens=1)
    assert blocks.match_prefix(b) == 40
    assert b.block_table == a_global
    first = blocks.first_needed(40)  # (40 - 15) // 4 = 6: blocks 6..9 hold positions the next query reads
    assert first == 6 and b.local_table == [-1] * 6 + a_local[6:]
    compute(blocks, b, b.num_remaining)  # the rest runs on the attached window
    assert b.num_computed == 43


def test_an_evicted_local_window_shortens_the_hit_to_where_the_window_is_cached():
    events = []
    blocks = two_pools(num_local=20, sink=events.append)
    a = Sequence("a", list(range(40)), max_tokens=1)
    prefill_and_decode(blocks, a, chunk=4, decode=0)
    blocks.free(a)
    # d re-reads a's first 4 blocks (its window there; 18 tokens, so none slides out), so they become the
    # most recently used local blocks; a's blocks 4 and 5 slid out while a ran, so they go first
    d = Sequence("d", list(range(16)) + [7] * 2, max_tokens=1)
    prefill_and_decode(blocks, d, chunk=8, decode=0)
    blocks.free(d)
    blocks.flush_events()
    # a filler takes every free local block and 6 cached ones: a's slid-out blocks 4, 5, then its window 6..9
    filler = Sequence("f", [5] * 4, max_tokens=1)
    blocks.allocate(filler, (len(blocks.local.free) + 6) * BS)
    blocks.flush_events()
    b = Sequence("b", list(range(40)) + [99], max_tokens=1)
    assert blocks.match_prefix(b) == 16  # global holds all 40 tokens; the local window only for 16
    assert len(b.block_table) == len(b.local_table) == 4 and min(b.local_table) >= 0  # window from position 0
    # local evictions are not reported: a global block still serves any hit whose window is cached
    assert not [e for e in events if e.kind == "evicted"]


def test_global_evictions_are_reported_and_end_the_chain():
    events = []
    blocks = two_pools(num_blocks=12, num_local=12, sink=events.append)
    a = Sequence("a", list(range(40)), max_tokens=1)
    prefill_and_decode(blocks, a, chunk=4, decode=0)
    blocks.free(a)
    blocks.flush_events()
    filler = Sequence("f", [5] * 4, max_tokens=1)
    blocks.allocate(filler, 3 * BS)  # 2 never-used global blocks, then a's tail block (evicted first)
    blocks.flush_events()
    evicted = [h for e in events if e.kind == "evicted" for h in e.hashes]
    assert len(evicted) == 1
    b = Sequence("b", list(range(40)) + [99], max_tokens=1)
    assert blocks.match_prefix(b) == 36  # the chain ends where the global block went


def test_rolled_back_drafts_give_both_pools_their_blocks_back():
    blocks = two_pools()
    seq = Sequence("s", list(range(30)), max_tokens=100)
    prefill_and_decode(blocks, seq, chunk=8, decode=3)  # 33 tokens computed
    seq.token_ids.append(7)
    before = (blocks.num_used, blocks.num_local_used)
    blocks.allocate(seq, 1 + 7)  # the last token and 7 drafts: positions 33..40, two new blocks
    assert blocks.num_used == before[0] + 2 and blocks.num_local_used == before[1] + 2
    blocks.truncate(seq, 35)  # one draft kept: positions up to 34 stay
    assert (blocks.num_used, blocks.num_local_used) == before
    assert len(seq.local_table) == len(seq.block_table) == 9


def run_to_end(sched: Scheduler) -> None:
    while sched.has_work():
        for seq, n in sched.schedule():
            seq.num_computed += n
            sched.blocks.commit_full_blocks(seq)
            if seq.num_computed == len(seq.token_ids):
                seq.token_ids.append(1000 + seq.num_output)
                if seq.num_output >= seq.max_tokens:
                    sched.finish(seq, "length")


def test_a_full_local_pool_preempts_and_the_preempted_loses_nothing():
    # three short prompts are admitted together; decoding past the window they need up to 3 x 5 local
    # blocks, and the pool has 12
    sched = Scheduler(two_pools(num_blocks=400, num_local=12), max_num_seqs=3, max_step_tokens=64)
    seqs = [Sequence(f"s{i}", [i] * 4, max_tokens=60) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert sched.preemptions > 0
    for s in seqs:
        assert s.status is SeqStatus.FINISHED and s.token_ids[4:] == [1000 + i for i in range(60)]
    assert sched.blocks.num_used == 0 and sched.blocks.num_local_used == 0


def test_the_step_batch_carries_the_local_tables_and_slots():
    import numpy as np

    from workers.cupy.batch import build_batch

    blocks = two_pools()
    seq = Sequence("s", list(range(30)), max_tokens=10)
    prefill_and_decode(blocks, seq, chunk=8, decode=0)
    seq.token_ids.append(5)
    blocks.allocate(seq, 1)
    batch = build_batch([(seq, 1)], BS, np)
    local = batch.local_meta.block_tables[0]
    first = blocks.first_needed(30)  # (30 - 15) // 4 = 3
    assert local[:first].tolist() == [0] * first and local[first:].tolist() == seq.local_table[first:]
    assert batch.local_slot_mapping.tolist() == [seq.local_table[30 // BS] * BS + 30 % BS]
    assert batch.slot_mapping.tolist() == [seq.block_table[30 // BS] * BS + 30 % BS]
    assert all(a is b for a, b in zip(batch.kv_args(True), (batch.slot_mapping, batch.meta)))
    assert all(a is b for a, b in zip(batch.kv_args(False), (batch.local_slot_mapping, batch.local_meta)))
    one = BlockManager(200, BS)
    other = Sequence("o", list(range(9)), max_tokens=1)
    one.allocate(other, 9)
    assert build_batch([(other, 9)], BS, np).local_meta is None  # one pool: every layer the same table


def test_reported_usage_is_the_fuller_pool_share():
    blocks = two_pools(num_blocks=100, num_local=10)
    seqs = [Sequence(f"s{i}", [i] * 8, max_tokens=1) for i in range(4)]
    for s in seqs:
        compute(blocks, s, 8)  # 2 blocks in each pool per sequence
    assert blocks.num_used == 8 and blocks.num_local_used == 8
    assert blocks.pressure_used == 80  # 8 of 10 local blocks: 80% of the 100 reported


def test_a_finished_conversation_keeps_its_last_window_through_a_long_prefill():
    """Found on the H200 routing replay: blocks sliding out of a long prompt's window went to the young end
    of the local LRU, so one long prefill flushed every finished sequence's last window and the next turn of
    each conversation found no usable prefix. Slid-out blocks now go first."""
    blocks = two_pools(num_local=20)  # the window's 5 blocks a running sequence needs, and a little more
    a = Sequence("a", list(range(40)), max_tokens=1)  # a conversation's turn
    prefill_and_decode(blocks, a, chunk=4, decode=0)
    blocks.free(a)
    long = Sequence("l", [7] * 200, max_tokens=1)  # another agent's long prompt: 50 blocks slide through
    prefill_and_decode(blocks, long, chunk=8, decode=0)
    blocks.free(long)
    nxt = Sequence("a2", list(range(40)) + [99, 98], max_tokens=1)  # the conversation's next turn
    assert blocks.match_prefix(nxt) == 40


def test_the_window_behind_the_prompt_end_outlives_a_long_prefill():
    """A next turn that resends the prompt but not the generated tokens (the agent rewrote its answer) hits
    at the prompt's last full block; that window slid out while the answer was decoded and must stay young."""
    blocks = two_pools(num_local=24)
    a = Sequence("a", list(range(42)), max_tokens=20)  # prompt 42 tokens: last full block ends at 40
    prefill_and_decode(blocks, a, chunk=4, decode=20)  # decoding slides the prompt-end window out
    blocks.free(a)
    long = Sequence("l", [7] * 200, max_tokens=1)
    prefill_and_decode(blocks, long, chunk=8, decode=0)
    blocks.free(long)
    nxt = Sequence("a2", list(range(42)) + [99, 98, 97], max_tokens=1)  # same prompt, another answer
    assert blocks.match_prefix(nxt) == 40


def test_a_full_batch_leaves_the_finished_conversations_windows_cached():
    """The planned local pool holds a full running batch and, besides it, the last windows of as many
    finished sequences: max_num_seqs conversations each find their prefix after a full batch of others ran."""
    plan = plan_pools(4096, BS, GEMMA, WINDOW, max_num_seqs=4, max_step_tokens=16)
    blocks = BlockManager.from_plan(plan, BS)
    convs = [Sequence(f"c{i}", [i * 1000 + t for t in range(40)], max_tokens=1) for i in range(4)]
    for seq in convs:
        prefill_and_decode(blocks, seq, chunk=8, decode=0)
        blocks.free(seq)
    batch = [Sequence(f"o{i}", [50_000 + i * 1000 + t for t in range(60)], max_tokens=1) for i in range(4)]
    for seq in batch:  # a full batch of other agents' prompts, running at once
        blocks.match_prefix(seq)
    for _ in range(60 // 4):
        for seq in batch:
            compute(blocks, seq, 4)
    for seq in batch:
        blocks.free(seq)
    for i in range(4):
        nxt = Sequence(f"n{i}", [i * 1000 + t for t in range(40)] + [7, 7], max_tokens=1)
        assert blocks.match_prefix(nxt) == 40, i
        blocks.free(nxt)


def test_a_long_answer_sliding_out_does_not_crowd_out_other_windows():
    """Only the window behind the prompt's end is kept young; generated text sliding out of a long answer goes
    cold like a long prompt's, so it cannot push a finished conversation's last window out."""
    blocks = two_pools(num_local=22)
    a = Sequence("a", list(range(40)), max_tokens=1)
    prefill_and_decode(blocks, a, chunk=4, decode=0)
    blocks.free(a)
    chatty = Sequence("c", [5000 + t for t in range(8)], max_tokens=300)  # a short prompt, a long answer
    prefill_and_decode(blocks, chatty, chunk=8, decode=200)
    blocks.free(chatty)
    nxt = Sequence("a2", list(range(40)) + [99, 98], max_tokens=1)
    assert blocks.match_prefix(nxt) == 40
