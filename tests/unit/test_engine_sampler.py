"""The batched sampler on small, known distributions: which tokens each truncation keeps, and in what
proportion a draw picks them."""
import numpy as np
import pytest

from workers.cupy.sampler import Sampler, SampleRow, uniform_for
from workers.protocol import SamplingParams

PROBS = np.array([0.5, 0.3, 0.1, 0.05, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)
GRID = (np.arange(400) + 0.5) / 400  # evenly spread draws: the counts show the distribution exactly


def draw_all(params: SamplingParams, logits=LOGITS, sampler=None, uniforms=GRID):
    sampler = sampler or Sampler(np)
    rows = [SampleRow(params, float(u)) for u in uniforms]
    tokens, _ = sampler.sample(np.tile(logits, (len(rows), 1)), rows)
    return tokens


def test_greedy_rows_take_the_argmax_whatever_the_draw():
    tokens = draw_all(SamplingParams(temperature=0.0))
    assert set(tokens.tolist()) == {0}


def test_plain_sampling_follows_the_distribution():
    counts = np.bincount(draw_all(SamplingParams(temperature=1.0)), minlength=5) / len(GRID)
    np.testing.assert_allclose(counts, PROBS, atol=1 / len(GRID) + 1e-9)


def test_temperature_sharpens():
    counts = np.bincount(draw_all(SamplingParams(temperature=0.5)), minlength=5) / len(GRID)
    want = PROBS**2 / (PROBS**2).sum()
    np.testing.assert_allclose(counts, want, atol=1 / len(GRID) + 1e-9)


@pytest.mark.parametrize(
    "params, support",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(top_p=0.85), {0, 1, 2}),
        (SamplingParams(min_p=0.25), {0, 1}),
        (SamplingParams(top_k=2, top_p=0.6), {0}),  # top-p after top-k: 0.5 / 0.8 >= 0.6 already
    ],
)
def test_truncation_keeps_exactly_its_support_renormalised(params, support):
    tokens = draw_all(params)
    assert set(tokens.tolist()) == support
    kept = np.array(sorted(support))
    counts = np.bincount(tokens, minlength=5)[kept] / len(GRID)
    np.testing.assert_allclose(counts, PROBS[kept] / PROBS[kept].sum(), atol=1 / len(GRID) + 1e-9)


def test_a_nucleus_wider_than_the_candidates_falls_back_to_a_full_sort():
    logits = np.zeros(1000, np.float32)  # flat: top_p=0.5 keeps 500 tokens, more than 16 candidates
    tokens = draw_all(SamplingParams(top_p=0.5), logits, Sampler(np, candidates=16), np.linspace(0, 0.999, 200))
    assert len(set(tokens.tolist())) > 100


def test_rows_with_different_settings_share_one_batch():
    rows = [SampleRow(SamplingParams(temperature=0.0), 0.99), SampleRow(SamplingParams(top_k=2), 0.99),
            SampleRow(SamplingParams(), 0.99)]
    tokens, _ = Sampler(np).sample(np.tile(LOGITS, (3, 1)), rows)
    assert tokens.tolist() == [0, 1, 4]


def test_seeded_draws_repeat_and_differ_by_position_and_seed():
    rng = np.random.default_rng()
    assert uniform_for(7, 3, rng) == uniform_for(7, 3, rng)
    assert len({uniform_for(7, i, rng) for i in range(20)}) == 20
    assert uniform_for(7, 3, rng) != uniform_for(8, 3, rng)


def test_logprobs_are_the_models_log_softmax_with_sorted_alternatives():
    rows = [SampleRow(SamplingParams(temperature=0.0), 0.5, logprobs=3), SampleRow(SamplingParams(), 0.5)]
    _, lps = Sampler(np).sample(np.tile(LOGITS, (2, 1)), rows)
    (entry,) = lps[0]
    assert entry.token_id == 0 and entry.logprob == pytest.approx(np.log(0.5), abs=1e-5)
    assert [t for t, _ in entry.top] == [0, 1, 2]
    assert [v for _, v in entry.top] == pytest.approx(np.log([0.5, 0.3, 0.1]).tolist(), abs=1e-5)
    assert lps[1] is None
