"""The sliding-window KV pool on the real model (NumPy path): Gemma 3's local layers keep only the last 512
positions, in their own pool; the tokens are those of the one-pool engine (every layer keeps the whole
context), prefix hits past the window give cold-run tokens, and preemption loses nothing.

Sizes: 256 all-layer blocks, 2 sequences, 128-token steps -> a 78-block local pool and 1146 global blocks in
the same bytes (4.5x the context tokens); the one-pool engine holds 256 blocks for every layer.
"""
from __future__ import annotations

import pytest

from tests.integration.engine_helpers import PROMPTS, encode, make_engine, run

N_TOKENS = 16
SIZES = dict(num_blocks=256, max_num_seqs=2, max_step_tokens=128)


@pytest.fixture(scope="module")
def prompts():
    p1 = encode(" ".join(PROMPTS * 12))[:700]
    p2 = encode(" ".join(list(reversed(PROMPTS)) * 12))[:640]
    return [p1, p2]


@pytest.fixture(scope="module")
def one_pool(prompts):
    """The reference: the same budget, every layer keeping every block (the engine before the local pool)."""
    engine = make_engine(window_pool=False, **SIZES)
    assert engine.blocks.local is None
    tokens, _ = run(engine, prompts, N_TOKENS, tag="ref")
    return tokens


def test_two_pools_hold_more_context_in_the_same_bytes_and_give_the_same_tokens(prompts, one_pool):
    before, after = make_engine(window_pool=False, **SIZES), make_engine(**SIZES)
    assert after.kv.nbytes <= before.kv.nbytes
    # the local pool: 2 running windows + a chunk, and a third of the rest for finished windows (plan_pools)
    assert (after.blocks.num_blocks, after.blocks.local.num_blocks) == (851, 137)
    assert after.capacity_tokens == 851 * 16 > 3 * before.capacity_tokens
    tokens, finals = run(after, prompts, N_TOKENS)
    assert tokens == one_pool
    assert after.blocks.num_used == 0 and after.blocks.num_local_used == 0


def test_local_blocks_stay_bounded_by_the_window_while_global_blocks_grow(prompts):
    from workers.protocol import GenerateRequest

    engine = make_engine(**SIZES)
    engine.add(GenerateRequest(request_id="long", prompt_ids=prompts[0] * 2, max_tokens=8, ignore_eos=True))
    seq = engine.seqs["long"]
    local, glob = [], []
    while engine.has_work():
        engine.step()
        if seq.finish_reason:  # its blocks are released: the last step's counts are the ones before
            break
        local.append(sum(b >= 0 for b in seq.local_table))
        glob.append(len(seq.block_table))
        assert engine.blocks.num_local_used == local[-1] and engine.blocks.num_used == glob[-1]
    # 1400 prompt tokens in 128-token chunks, then decode: the local window never holds more than the 512
    # positions a query reads (32 blocks, 33 when unaligned), the block being written and one chunk's blocks
    assert max(local) <= 512 // 16 + 2 + 128 // 16
    assert local[-1] <= 512 // 16 + 2
    assert glob[-1] == -(-(1400 + 7) // 16) and glob == sorted(glob)  # the last token is never computed


def test_a_prefix_hit_past_the_window_gives_the_cold_tokens(prompts, one_pool):
    engine = make_engine(**SIZES)
    cold, finals = run(engine, [prompts[0]], N_TOKENS, tag="cold")
    assert cold[0] == one_pool[0] and finals[0].cached_tokens == 0
    again, finals = run(engine, [prompts[0]], N_TOKENS, tag="again")
    assert again == cold and finals[0].cached_tokens == (700 - 1) // 16 * 16  # 688: past the 512 window
    # a conversation going on: the earlier prompt, its answer and a new turn; cold on a fresh engine
    turn = prompts[0] + cold[0] + encode(" Tell me more.")[1:]
    warm, finals = run(engine, [turn], 8, tag="turn")
    assert finals[0].cached_tokens >= 688
    fresh, _ = run(make_engine(**SIZES), [turn], 8, tag="fresh")
    assert warm == fresh


def test_preemption_past_the_window_loses_nothing(prompts, one_pool):
    # 76 blocks of budget, below what two windows and a chunk take (78): both pools get 76 blocks, and the
    # two sequences (45 + 41 global blocks) cannot both stay: the newer is preempted and recomputed later,
    # its local window rebuilt from the prefix cache or recomputed
    engine = make_engine(num_blocks=76, max_num_seqs=2, max_step_tokens=128)
    assert (engine.blocks.num_blocks, engine.blocks.local.num_blocks) == (76, 76)
    tokens, _ = run(engine, prompts, N_TOKENS, tag="p")
    assert engine.scheduler.preemptions > 0
    assert tokens == one_pool


def test_speculation_past_the_window_rolls_back_in_both_pools(prompts, one_pool):
    from policy.profiles import DeviceProfile, SpeculationRule
    from workers.cupy.speculative import Speculator

    engine = make_engine(**SIZES)
    engine.speculator = Speculator(DeviceProfile(name="k4", max_draft_tokens=4,
                                                 speculation=[SpeculationRule(max_context=10**9, k=4)]))
    tokens, finals = run(engine, prompts, N_TOKENS, tag="s")
    assert tokens == one_pool
    drafted, accepted = sum(f.drafted_tokens for f in finals), sum(f.accepted_tokens for f in finals)
    assert 0 < accepted < drafted  # the repeated prompts draft (prompt lookup), and one draft is rolled back
    assert engine.blocks.num_used == 0 and engine.blocks.num_local_used == 0
