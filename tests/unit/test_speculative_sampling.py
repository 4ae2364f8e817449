"""Speculation's acceptance rule on synthetic logits (no model): drafts are kept while they equal the
sampler's keyed draws; greedy keeps exactly the argmax chain, and sampled rows emit tokens distributed as
the sampler's own distribution (rejection sampling against a point-mass draft, with coupled draws)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from workers.cupy.rng import row_key
from workers.cupy.sampler import Sampler, SampleRow
from workers.cupy.sequence import Sequence
from workers.cupy.speculative import _accept_greedy, _cut_at_stop
from workers.protocol import SamplingParams

V = 12


def test_greedy_keeps_matching_drafts_then_the_models_token():
    assert _accept_greedy([5, 6, 7], [5, 6, 7, 8]) == ([5, 6, 7, 8], 3)
    assert _accept_greedy([5, 6, 7], [5, 9, 7, 8]) == ([5, 9], 1)
    assert _accept_greedy([5], [4, 1]) == ([4], 0)


def test_cut_at_stop_and_at_the_token_limit():
    seq = Sequence("s", [1, 2], max_tokens=10, stop_token_ids=frozenset({9}))
    assert _cut_at_stop(seq, [3, 9, 4]) == [3, 9]
    seq = Sequence("s", [1, 2], max_tokens=2)
    assert _cut_at_stop(seq, [3, 4, 5]) == [3, 4]


def _emitted(params: SamplingParams, logits: np.ndarray, draft: list[int], n: int, seed: int):
    """n verifications of `draft` over `logits` (one row per position), each with its own request seed."""
    sampler, out = Sampler(np), []
    for r in range(n):
        rows = [SampleRow(params, row_key(seed * 1_000_003 + r, i)) for i in range(len(draft) + 1)]
        targets, _ = sampler.sample(logits[: len(rows)], rows)
        out.append(_accept_greedy(draft, targets.tolist()))
    return out


def _target(params: SamplingParams, row: np.ndarray) -> np.ndarray:
    kept = Sampler(np).truncated_probs(row[None, :], [SampleRow(params)], np.array([params.temperature], np.float32))[0]
    return kept / kept.sum()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=1.3, top_k=5, min_p=0.02)])
@pytest.mark.parametrize("draft_rank", [0, 7])  # a likely draft, a middling one, an unlikely one
def test_rejection_sampling_matches_the_target_distribution(params, draft_rank):
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1.5, (3, V)).astype(np.float32)
    p0, p1 = _target(params, logits[0]), _target(params, logits[1])
    d0 = int(np.argsort(-logits[0])[draft_rank])
    d1 = int(np.argmax(logits[1]))
    n = 4000
    runs = _emitted(params, logits, [d0, d1], n, seed=draft_rank)
    first = Counter(emitted[0] for emitted, _ in runs)
    _check(first, p0, n)
    # given the first draft was kept, the second emitted token follows the second position's distribution
    second = Counter(emitted[1] for emitted, _ in runs if emitted[0] == d0)
    _check(second, p1, sum(second.values()))
    kept = Counter(k for _, k in runs)
    assert abs(kept[0] / n - (1 - p0[d0])) < 0.03  # rejections at position 1 happen at rate 1 - p(d)


def _check(counts: Counter, p: np.ndarray, n: int) -> None:
    if n < 200:
        return
    p = p.astype(np.float64) / p.astype(np.float64).sum()
    support = np.flatnonzero(p > 0)
    assert set(counts) <= set(support.tolist())  # never a token outside top-k/top-p/min-p
    big = [t for t in support if p[t] * n >= 5]
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    expected = [p[t] * n for t in big] + [n * (1 - p[big].sum())]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    expected = np.array(expected, np.float64)
    expected *= sum(observed) / expected.sum()
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


def test_seeded_verification_emits_what_plain_sampling_draws():
    """The emitted tokens are the plain draws at their positions, whatever the draft."""
    logits = np.random.default_rng(2).normal(0, 1.5, (3, V)).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=77)
    rows = [SampleRow(params, row_key(77, i)) for i in range(3)]
    plain = Sampler(np).sample(logits, rows)[0].tolist()
    for draft in ([plain[0], plain[1]], [plain[0], (plain[1] + 1) % V], [(plain[0] + 1) % V, 0]):
        emitted, kept = _accept_greedy(draft, plain)
        assert emitted == plain[: len(emitted)] and len(emitted) == kept + 1
