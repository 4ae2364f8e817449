"""Acceptance-aware speculation depth (policy.speculation.choose_depth): drafts that stop paying fall to
depth 0 and probe now and then; drafts that keep paying stay at the table's cap. Driven by the real
prompt-lookup drafter over synthetic token streams, with verification's keep rule."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.speculation import (PRIOR, PROBE_EVERY, Acceptance, AcceptancePrior, choose_depth, next_depth,
                               tokens_per_cost)
from workers.cupy.drafter import Drafter
from workers.cupy.speculative import _accept_greedy

CAP = 4
COST = 0.05


def decode(stream: list[int], prompt_len: int, concurrency: int = 1, acc: Acceptance | None = None) -> list[int]:
    """Generate `stream` after its first prompt_len tokens with speculation; the depth chosen each step."""
    drafter, acc = Drafter(), acc or Acceptance()
    tokens, depths = list(stream[:prompt_len]), []
    while len(tokens) < len(stream):
        k = choose_depth(CAP, acc, concurrency, COST)
        depths.append(k)
        draft = drafter.propose(tokens, min(k, len(stream) - len(tokens) - 1))
        truth = stream[len(tokens) : len(tokens) + len(draft) + 1]
        emitted, kept = _accept_greedy(draft, truth)
        if draft:
            acc.update(len(draft), kept)
        tokens += emitted
    return depths


def test_depth_falls_to_zero_when_drafts_never_match():
    # random tokens from a small vocabulary: prompt lookup finds n-gram matches, their continuations are noise
    stream = np.random.default_rng(0).integers(0, 40, 2000).tolist()
    depths = decode(stream, 200)
    tail = depths[len(depths) // 2 :]
    assert np.mean([d == 0 for d in tail]) > 0.9
    assert 0 < sum(d > 0 for d in tail) <= len(tail) // PROBE_EVERY + 1  # only probes, one token each
    assert max(tail) == 1


def test_depth_stays_at_the_cap_on_a_code_edit():
    # the output copies a file from the prompt with one identifier renamed: lookup drafts are mostly right
    rng = np.random.default_rng(1)
    source = rng.integers(100, 5000, 600).tolist()
    edited = [7 if t == source[10] else t for t in source]
    depths = decode(source + [1, 2] + edited, len(source) + 2)
    assert np.mean([d == CAP for d in depths]) > 0.9


def test_a_sequence_whose_text_starts_repeating_recovers_through_probes():
    rng = np.random.default_rng(2)
    noise = rng.integers(0, 40, 1000).tolist()
    block = rng.integers(100, 5000, 300).tolist()
    depths = decode(noise + block + block, 100)
    assert depths[-50:].count(CAP) > 40


@pytest.mark.parametrize("concurrency", [1, 8, 64])
def test_no_depth_beats_plain_decoding_without_acceptance(concurrency):
    acc = Acceptance()
    acc.rates = [0.0] * len(acc.rates)
    assert choose_depth(CAP, acc, concurrency, COST) == 0


def test_high_concurrency_wants_more_acceptance_per_draft():
    """At one stream a draft costs ~nothing next to the step; at 64 the batch already fills the step."""
    acc = Acceptance()
    acc.rates = [0.3] * len(acc.rates)
    assert choose_depth(CAP, acc, 1, COST) > 0
    assert choose_depth(CAP, acc, 64, COST) == 0
    assert tokens_per_cost(0.0, 0, 1, COST) == pytest.approx(1.0)


def test_the_request_cap_and_table_still_bound_the_depth():
    acc = Acceptance()
    acc.rates = [1.0] * len(acc.rates)
    assert choose_depth(2, acc, 1, COST) == 2
    assert choose_depth(0, acc, 1, COST) == 0


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(0, 8), rates=st.lists(st.floats(0.0, 1.0), min_size=16, max_size=16),
       idle=st.integers(0, PROBE_EVERY - 1), concurrency=st.integers(1, 512), cost=st.floats(0.0, 2.0))
def test_next_depth_says_what_choose_depth_will_do_without_counting_the_step(cap, rates, idle, concurrency, cost):
    """The engine asks next_depth before it launches a step ahead (no draft possible without the latest token):
    it must agree with the choose_depth the step would otherwise run, and leave the probe count alone."""
    acc = Acceptance()
    acc.rates, acc.idle = list(rates), idle
    ahead = next_depth(cap, acc, concurrency, cost)
    assert (acc.rates, acc.idle) == (list(rates), idle)
    assert ahead == choose_depth(cap, acc, concurrency, cost)


def test_a_new_sequence_starts_from_what_its_kind_ended_with():
    """Noise (drafts never kept) teaches its kind's prior: the next such sequence starts at depth 0 instead of
    drafting deep until its own rejections bring it down; a code edit of another kind still starts drafting
    deep, and a sequence that never drafted teaches nothing."""
    rng = np.random.default_rng(3)
    prior = AcceptancePrior()
    fresh = decode(rng.integers(0, 40, 400).tolist(), 100, acc=prior.start("noise"))
    assert fresh[0] > 1 and sum(d > 1 for d in fresh) >= 3  # the fixed 0.5: drafts deep before it learns
    for _ in range(6):
        acc = prior.start("noise")
        decode(rng.integers(0, 40, 400).tolist(), 100, acc=acc)
        prior.ended("noise", acc)
    learned = decode(rng.integers(0, 40, 400).tolist(), 100, acc=prior.start("noise"))
    assert learned[: PROBE_EVERY - 1] == [0] * (PROBE_EVERY - 1) and max(learned) <= 1  # probes only
    assert prior.start("code").rates[0] == PRIOR
    source = rng.integers(100, 5000, 300).tolist()
    assert decode(source + [1, 2] + source, len(source) + 2, acc=prior.start("code"))[0] > 1
    before = prior.start("noise").rates
    prior.ended("noise", Acceptance(prior=[1.0] * 16))  # never verified a draft: only the prior it was given
    assert prior.start("noise").rates == before


def test_a_kind_that_starts_repeating_comes_back():
    """The prior follows its kind: sequences whose drafts are kept again raise it, so new ones draft again."""
    rng = np.random.default_rng(4)
    prior = AcceptancePrior()
    for _ in range(6):
        acc = prior.start("text")
        decode(rng.integers(0, 40, 400).tolist(), 100, acc=acc)
        prior.ended("text", acc)
    assert decode(rng.integers(0, 40, 200).tolist(), 100, acc=prior.start("text"))[0] == 0
    for _ in range(6):
        block = rng.integers(100, 5000, 200).tolist()
        acc = prior.start("text")
        decode(rng.integers(0, 40, 100).tolist() + block + block, 100, acc=acc)
        prior.ended("text", acc)
    block = rng.integers(100, 5000, 200).tolist()
    assert decode(block + [1] + block, 201, acc=prior.start("text"))[0] > 1
