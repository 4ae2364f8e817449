"""Block bookkeeping: allocation, content-addressed prefix reuse, reference counts, LRU eviction, events."""
from cache.hashing import chain_hashes
from workers.cupy.kv_cache import BlockManager
from workers.cupy.sequence import Sequence

BS = 4


def run_prefill(blocks: BlockManager, seq: Sequence) -> None:
    """What the engine does for a whole prompt: attach cached prefix, allocate, 'compute', register."""
    blocks.match_prefix(seq)
    n = seq.num_remaining
    assert blocks.can_allocate(seq, n)
    blocks.allocate(seq, n)
    seq.num_computed += n
    blocks.commit_full_blocks(seq)
    blocks.flush_events()


def test_full_blocks_are_registered_with_the_router_hash_and_reported():
    events = []
    blocks = BlockManager(8, BS, events.append)
    seq = Sequence("a", list(range(10)), max_tokens=4)
    run_prefill(blocks, seq)
    assert len(seq.block_table) == 3 and blocks.num_used == 3
    assert [(e.kind, e.hashes) for e in events] == [("added", chain_hashes(list(range(10)), BS))]


def test_a_shared_prefix_is_attached_not_recomputed_and_refcounted():
    blocks = BlockManager(8, BS)
    a = Sequence("a", list(range(10)), max_tokens=4)
    run_prefill(blocks, a)
    b = Sequence("b", list(range(8)) + [99, 98, 97], max_tokens=4)
    assert blocks.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    blocks.allocate(b, b.num_remaining)
    assert blocks.num_used == 4  # 3 of a, 2 shared, 1 new for b
    blocks.free(a)
    assert blocks.num_used == 3  # b still holds the two shared blocks
    blocks.free(b)
    assert blocks.num_used == 0 and blocks.num_cached == 2


def test_at_least_one_token_is_left_to_compute():
    blocks = BlockManager(8, BS)
    run_prefill(blocks, Sequence("a", list(range(8)), max_tokens=1))
    again = Sequence("b", list(range(8)), max_tokens=1)
    assert blocks.match_prefix(again) == 4  # the second block is cached, but its last token must run
    assert again.num_remaining == 4


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_tail_first():
    events = []
    blocks = BlockManager(4, BS, events.append)
    old = Sequence("old", list(range(9)), max_tokens=1)
    run_prefill(blocks, old)  # blocks for [0..3], [4..7], and a partial one
    blocks.free(old)
    hashes = chain_hashes(list(range(9)), BS)
    events.clear()
    new = Sequence("new", [50 + i for i in range(13)], max_tokens=1)
    blocks.allocate(new, 9)  # 3 blocks: the never-used one, old's partial one (no hash), then one cached
    blocks.flush_events()
    assert [(e.kind, e.hashes) for e in events] == [("evicted", [hashes[1]])]  # the tail of the prefix first
    assert blocks.num_free == 1 and blocks.num_cached == 1
    blocks.allocate(new, 13)
    blocks.flush_events()
    assert events[-1].hashes == [hashes[0]] and blocks.num_free == 0 and blocks.num_cached == 0


def test_a_hit_moves_blocks_to_the_back_of_the_eviction_order():
    blocks = BlockManager(4, BS)
    a, b = Sequence("a", [1] * 5, max_tokens=1), Sequence("b", [2] * 5, max_tokens=1)
    run_prefill(blocks, a), run_prefill(blocks, b)
    blocks.free(a), blocks.free(b)
    a2 = Sequence("a2", [1] * 5, max_tokens=1)
    run_prefill(blocks, a2)  # reuses a's block, makes it recently used
    blocks.free(a2)
    c = Sequence("c", [3] * 12, max_tokens=1)  # 3 blocks: the 2 plain free ones, then evict one cached
    blocks.allocate(c, 12)
    assert blocks.match_prefix(Sequence("probe", [1] * 5, max_tokens=1)) == 4  # a's survived, b's went


def test_the_same_block_computed_twice_is_cached_once():
    events = []
    blocks = BlockManager(8, BS, events.append)
    a, b = Sequence("a", [7] * 5, max_tokens=1), Sequence("b", [7] * 5, max_tokens=1)
    for s in (a, b):  # both admitted in one step, before either block was registered
        blocks.allocate(s, 5)
    for s in (a, b):
        s.num_computed = 5
        blocks.commit_full_blocks(s)
    blocks.flush_events()
    assert [len(e.hashes) for e in events] == [1] and blocks.num_cached == 1
    blocks.free(a), blocks.free(b)
    assert blocks.num_free == 8


def test_allocation_is_refused_when_blocks_run_out():
    blocks = BlockManager(2, BS)
    s = Sequence("s", list(range(12)), max_tokens=1)
    assert not blocks.can_allocate(s, 12)
    assert blocks.can_allocate(s, 8)


def test_a_hash_collision_cannot_attach_another_prefixs_blocks(monkeypatch):
    """Reuse checks the whole prefix, not a block's own tokens: with a block hash that collides whenever
    two blocks hold the same tokens (here: one that ignores the parent, standing in for a forged or chance
    XXH3 collision), a prompt that starts with the tokens of another's second block must not get that block,
    whose K/V were computed after the other prompt's first block."""
    import workers.cupy.kv_cache as kv

    monkeypatch.setattr(kv, "block_hash", lambda parent, tokens: hash(tuple(tokens)) & (2**63 - 1))
    blocks = BlockManager(16, BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    run_prefill(blocks, Sequence("a", x + y + z + [0], max_tokens=4))
    assert blocks.match_prefix(Sequence("b", y + z + [0], max_tokens=4)) == 0  # y, z here follow nothing
    same = Sequence("c", x + y + [0], max_tokens=4)
    assert blocks.match_prefix(same) == 8  # the true prefix still hits


def test_a_duplicate_block_still_passes_its_key_to_the_next():
    """Two requests computing one prefix in the same step: the second's copy is not registered (the first
    stays), yet the blocks it commits after it still carry the right whole-prefix key, so they hit later."""
    blocks = BlockManager(16, BS)
    a, b = Sequence("a", list(range(9)), max_tokens=4), Sequence("b", list(range(4)) + [50, 51, 52, 53, 0], max_tokens=4)
    for s in (a, b):
        blocks.match_prefix(s)
        blocks.allocate(s, s.num_remaining)
    for s in (a, b):
        s.num_computed += s.num_remaining
        blocks.commit_full_blocks(s)
    later = Sequence("c", list(range(4)) + [50, 51, 52, 53, 7], max_tokens=4)
    assert blocks.match_prefix(later) == 8


def test_blocks_are_named_from_the_models_chain_root_as_the_router_names_them():
    """Two engines of two models fed the same ids publish disjoint hashes, each the chain the router computes
    from that model's root; a block committed under one root is not found by a lookup from another."""
    from cache.hashing import chain_root

    ids = list(range(10))
    published = {}
    for identity in ("gguf:1:aa", "gguf:1:ab"):
        events, root = [], chain_root(identity)
        blocks = BlockManager(8, BS, events.append, root=root)
        run_prefill(blocks, Sequence("a", ids, max_tokens=4))
        assert [(e.kind, e.hashes) for e in events] == [("added", chain_hashes(ids, BS, root.hash))]
        published[identity] = (blocks, set(events[0].hashes))
    (a, in_a), (b, in_b) = published.values()
    assert not in_a & in_b
    b.root = a.root  # the same ids looked up from the other model's root: nothing of b's cache matches
    assert b.match_prefix(Sequence("c", ids, max_tokens=1)) == 0
