"""Continuous batching without a model: the scheduler's choices, with the engine's bookkeeping simulated."""
from workers.cupy.kv_cache import BlockManager
from workers.cupy.scheduler import Scheduler
from workers.cupy.sequence import Sequence, SeqStatus

BS = 4


def step(sched: Scheduler, next_token=lambda seq: 1000 + seq.num_output, graph_tokens: int = 0):
    """Schedule, then do what the engine does after a forward pass: advance, register, sample, finish."""
    scheduled = sched.schedule(graph_tokens)
    for seq, n in scheduled:
        seq.num_computed += n
        sched.blocks.commit_full_blocks(seq)
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(next_token(seq))
            if seq.num_output >= seq.max_tokens:
                sched.finish(seq, "length")
    return [(s.request_id, n) for s, n in scheduled]


def test_prefill_is_chunked_under_the_token_budget_and_decodes_share_the_step():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=4, max_step_tokens=8)
    a = Sequence("a", list(range(3)), max_tokens=5)
    sched.add(a)
    assert step(sched) == [("a", 3)]
    sched.add(Sequence("b", list(range(100, 120)), max_tokens=2))
    assert step(sched) == [("a", 1), ("b", 7)]  # a decodes; b prefills with what is left of the budget
    assert step(sched) == [("a", 1), ("b", 7)]
    assert step(sched) == [("a", 1), ("b", 6)]  # b's last chunk: it samples its first token
    assert step(sched) == [("a", 1), ("b", 1)]


def test_max_num_seqs_holds_new_requests_back_until_a_slot_frees():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=2, max_step_tokens=64)
    for i in range(3):
        sched.add(Sequence(f"s{i}", [i] * 3, max_tokens=2))
    assert step(sched) == [("s0", 3), ("s1", 3)]
    assert len(sched.waiting) == 1
    assert step(sched) == [("s0", 1), ("s1", 1)]  # both finish here
    assert step(sched) == [("s2", 3)]


def test_running_out_of_blocks_preempts_the_newest_and_it_resumes_with_its_tokens():
    sched = Scheduler(BlockManager(4, BS), max_num_seqs=4, max_step_tokens=64)
    old, new = Sequence("old", [1] * 4, max_tokens=6), Sequence("new", [2] * 4, max_tokens=6)
    sched.add(old), sched.add(new)
    step(sched)  # one block each for the 4 prompt tokens
    for _ in range(4):  # positions 4..7 fill a second block each: the cache is full
        step(sched)
    assert sched.preemptions == 0 and sched.blocks.num_free == 0
    step(sched)  # both need a third block and none is free: the newest goes back to the queue
    assert sched.preemptions == 1 and new.status is SeqStatus.WAITING and new.num_computed == 0
    generated_before = list(new.token_ids)
    while old.status is not SeqStatus.FINISHED:
        step(sched)
    while new.status is not SeqStatus.FINISHED:
        step(sched)
    assert new.token_ids[: len(generated_before)] == generated_before  # nothing it had generated was lost
    assert new.num_output == 6 and old.num_output == 6
    assert sched.blocks.num_used == 0


def test_a_readmitted_sequence_reuses_its_own_cached_blocks():
    sched = Scheduler(BlockManager(16, BS), max_num_seqs=4, max_step_tokens=64)
    s = Sequence("s", list(range(9)), max_tokens=4)
    sched.add(s)
    step(sched), step(sched)
    sched.preempt(s)
    assert step(sched) == [("s", 3)]  # 8 of its 11 tokens come back from the prefix cache
    assert s.num_cached == 0  # reported cached tokens are those of the first admission


def test_prefill_coalescing_holds_arrivals_while_others_decode_then_admits_them_together():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_step_tokens=64, prefill_wait_steps=3)
    sched.add(Sequence("a", [1, 2, 3], max_tokens=50))
    assert step(sched) == [("a", 3)]  # nothing running: an arrival is admitted at once
    sched.add(Sequence("b", [4, 5], max_tokens=50))
    assert step(sched) == [("a", 1)]  # b waits: the step stays a pure decode
    sched.add(Sequence("c", [6, 7], max_tokens=50))
    assert step(sched) == [("a", 1)]
    assert step(sched) == [("a", 1), ("b", 2), ("c", 2)]  # b has waited 3 steps: both join one prefill step
    assert sched.held_steps == 2
    assert step(sched) == [("a", 1), ("b", 1), ("c", 1)]


def test_prefill_coalescing_admits_at_once_into_a_step_that_already_prefills():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=4, max_step_tokens=6, prefill_wait_steps=100)
    sched.add(Sequence("a", list(range(10)), max_tokens=5))
    assert step(sched) == [("a", 6)]
    sched.add(Sequence("b", [4, 5], max_tokens=5))
    assert step(sched) == [("a", 4), ("b", 2)]  # a's last chunk makes the step eager: b rides along
    sched.add(Sequence("c", [6], max_tokens=5))
    assert step(sched) == [("a", 1), ("b", 1)]  # decodes only: c is held


def test_prefill_coalescing_never_holds_a_preempted_sequence():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_step_tokens=64, prefill_wait_steps=100)
    a, b = Sequence("a", [1, 2, 3], max_tokens=50), Sequence("b", [4, 5, 6], max_tokens=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.preempt(b)
    assert step(sched) == [("a", 1), ("b", 4)]  # recomputed at once (prompt + its one token), not held 100 steps


def test_without_prefill_wait_an_arrival_joins_the_next_step():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_step_tokens=64)
    sched.add(Sequence("a", [1, 2, 3], max_tokens=50))
    step(sched)
    sched.add(Sequence("b", [4, 5], max_tokens=50))
    assert step(sched) == [("a", 1), ("b", 2)]
    assert sched.held_steps == 0


def test_arrivals_beside_decodes_join_only_up_to_the_graph_and_the_rest_join_the_next_step():
    sched = Scheduler(BlockManager(256, BS), max_num_seqs=16, max_step_tokens=64)
    for i in range(4):
        sched.add(Sequence(f"d{i}", [i] * 3, max_tokens=50))
    assert step(sched, graph_tokens=16) == [(f"d{i}", 3) for i in range(4)]  # nothing running: the full budget
    for i in range(5):  # five 3-token prompts arrive together beside 4 decodes: 19 tokens, past a 16-token graph
        sched.add(Sequence(f"n{i}", [10 + i] * 3, max_tokens=50))
    decodes = [(f"d{i}", 1) for i in range(4)]
    assert step(sched, graph_tokens=16) == decodes + [("n0", 3), ("n1", 3), ("n2", 3), ("n3", 3)]
    assert step(sched, graph_tokens=16) == decodes + [(f"n{i}", 1) for i in range(4)] + [("n4", 3)]
    # without a graph to fit (a CPU model, mixed graphs off) all five join the one step, as before
    plain = Scheduler(BlockManager(256, BS), max_num_seqs=16, max_step_tokens=64)
    for i in range(4):
        plain.add(Sequence(f"d{i}", [i] * 3, max_tokens=50))
    step(plain)
    for i in range(5):
        plain.add(Sequence(f"n{i}", [10 + i] * 3, max_tokens=50))
    assert step(plain) == decodes + [(f"n{i}", 3) for i in range(5)]


def test_the_graph_cap_leaves_a_step_that_is_eager_anyway_and_a_running_prefill_alone():
    sched = Scheduler(BlockManager(256, BS), max_num_seqs=16, max_step_tokens=64)
    sched.add(Sequence("a", [1, 2, 3], max_tokens=50))
    step(sched, graph_tokens=8)
    sched.add(Sequence("long", list(range(100, 140)), max_tokens=5))
    # a's decode (1) + the long prompt's first chunk, capped to the graph's 8 tokens: 7
    assert step(sched, graph_tokens=8) == [("a", 1), ("long", 7)]
    sched.add(Sequence("b", [7, 8], max_tokens=5))
    # the running prefill takes what the budget allows (33 of its 40, past the graph: this step is eager), and
    # b joins it at once: capping b would not save the step from running eagerly
    assert step(sched, graph_tokens=8) == [("a", 1), ("long", 33), ("b", 2)]
