"""Turn ends of a conversation keep their sliding-window blocks (kv_cache.BlockManager._kept): a turn that
edits the middle of its history hits at the last turn end before the edit, and the kept windows stay in the
LRU (reclaimed when the pool needs them), with the real BlockManager."""
from workers.cupy.kv_cache import BlockManager
from workers.cupy.sequence import Sequence

BS, WINDOW = 4, 16  # the window behind a turn end is 4 blocks


def two_pools(num_local: int) -> BlockManager:
    return BlockManager(2000, BS, num_local=num_local, window=WINDOW)


def run_turn(blocks: BlockManager, prompt: list[int], chunk: int = 8, decode: int = 2) -> int:
    """One request as the engine runs it: prefix match, chunked prefill, a few decoded tokens, free.
    Returns the cached tokens."""
    seq = Sequence("r", list(prompt), max_tokens=decode)
    hit = blocks.match_prefix(seq)
    while seq.num_remaining:
        n = min(chunk, seq.num_remaining)
        assert blocks.can_allocate(seq, n)
        blocks.allocate(seq, n)
        seq.num_computed += n
        blocks.commit_full_blocks(seq)
    for i in range(decode):  # generated ids the next turn does not carry (the client re-renders the answer)
        seq.token_ids.append(90_000 + i)
        blocks.allocate(seq, 1)
        seq.num_computed += 1
        blocks.commit_full_blocks(seq)
    blocks.free(seq)
    return hit


def conversation(turns: int, start: int = 20, step: int = 24) -> list[list[int]]:
    """Each turn's prompt: the previous prompt and `step` new tokens (turn ends at 20, 44, 68, ...: their
    windows do not overlap)."""
    tokens = list(range(start + step * (turns - 1)))
    return [tokens[: start + step * t] for t in range(turns)]


def churn(blocks: BlockManager, n_tokens: int = 240) -> None:
    """Another agent's long prompt: its slid-out blocks take every cold block in the local pool."""
    run_turn(blocks, [50_000 + i for i in range(n_tokens)], chunk=16, decode=0)


def test_an_edited_turn_hits_at_the_last_turn_end_before_the_edit():
    blocks = two_pools(num_local=48)
    prompts = conversation(6)  # turn ends 20, 44, 68, 92, 116, 140
    hits = [run_turn(blocks, p) for p in prompts]
    assert hits == [0, 20, 44, 68, 92, 116]  # every turn hits at the previous turn's prompt end
    churn(blocks)
    edited = list(prompts[-1])
    edited[69] = 77_777  # an edit in the middle: the history diverges at token 69, after the turn end at 68
    edited += [1, 2, 3]
    # before the hit point's window was kept young, it went cold when the next turn slid past it and the
    # churn reclaimed it: only the newest turn end (140, after the edit) kept its window, so the hit was 0
    assert run_turn(blocks, edited) == 68
    # the continuing conversation still hits at its newest turn end
    assert run_turn(blocks, prompts[-1] + [4, 5, 6, 7]) == 140


def test_kept_windows_stay_reclaimable_and_are_not_tracked_past_free():
    """Many turns on a pool that holds ~8 turn-end windows: no allocation is refused, the oldest turn ends
    give way (LRU) while the newest still hit, and nothing is left referenced or tracked."""
    blocks = two_pools(num_local=48)
    prompts = conversation(40)
    hits = [run_turn(blocks, p) for p in prompts]
    assert hits[1:] == [len(p) for p in prompts[:-1]]
    churn(blocks)
    assert blocks.num_local_used == 0 and not blocks._hit_windows
    assert len(blocks.local.cached_free) <= blocks.local.num_blocks
    recent = list(prompts[-4])
    recent[len(prompts[-5]) + 1] = 77_777  # an edit just after the turn end 4 turns back: its window is kept
    assert run_turn(blocks, recent + [1]) == len(prompts[-5])
    early = list(prompts[-1])
    early[len(prompts[2]) + 1] = 77_777  # an edit after the 3rd turn end: that window was reclaimed long ago
    assert run_turn(blocks, early + [1]) == 0


def test_a_preempted_sequence_drops_its_hit_window():
    blocks = two_pools(num_local=48)
    prompts = conversation(3)
    run_turn(blocks, prompts[0])
    seq = Sequence("p", list(prompts[1]), max_tokens=1)
    assert blocks.match_prefix(seq) == 20 and blocks._hit_windows[seq] == range(1, 5)
    blocks.free(seq)  # what Scheduler.preempt and a refused admission do
    assert seq not in blocks._hit_windows and blocks.num_local_used == 0
