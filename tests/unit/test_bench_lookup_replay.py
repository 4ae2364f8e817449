"""bench/lookup_replay.py's replay: the drafter's steps on a given output, with and without waits after misses."""
from __future__ import annotations

from bench.lookup_replay import replay


def test_a_copy_is_verified_in_steps_of_k_plus_one():
    prompt = list(range(10, 60))
    steps = replay(prompt, list(range(12, 48)), k=8, wait_max=8)  # continues the prompt's run from 12 on
    # the first search finds "... 58 59" nowhere earlier: one miss, a wait of 1, then drafts of 8 kept whole
    assert steps == {"verify": 4, "missed": 1, "plain": 1}


def test_misses_wait_one_two_four_then_the_cap():
    prompt = [1, 2, 3, 4]
    output = list(range(100, 140))  # nothing in it ever occurs earlier
    assert replay(prompt, output, k=4, wait_max=0) == {"verify": 0, "missed": 40, "plain": 0}
    steps = replay(prompt, output, k=4, wait_max=4)
    # misses at steps 0, 2, 5, 10, 15, 20, 25, 30, 35 (waits 1, 2, 4, 4, ...): 9 searches, the rest waiting
    assert steps == {"verify": 0, "missed": 9, "plain": 31}
