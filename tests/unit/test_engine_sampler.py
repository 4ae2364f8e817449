"""The batched sampler on small, known distributions: which tokens each truncation keeps, in what
proportion the keyed Gumbel-max draw picks them, and that a draw depends only on its key."""
import numpy as np
import pytest
from scipy.stats import chisquare

from workers.cupy.rng import NOISE_MAX, gumbel, row_key
from workers.cupy.sampler import Sampler, SampleRow
from workers.protocol import SamplingParams

PROBS = np.array([0.5, 0.3, 0.1, 0.05, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)
N = 4000
KEYS = [row_key(12345, i) for i in range(N)]


def draw_all(params: SamplingParams, logits=LOGITS, sampler=None, keys=KEYS):
    sampler = sampler or Sampler(np)
    rows = [SampleRow(params, k) for k in keys]
    tokens, _ = sampler.sample(np.tile(logits, (len(rows), 1)), rows)
    return tokens


def assert_follows(tokens: np.ndarray, probs: np.ndarray) -> None:
    support = np.flatnonzero(probs > 0)
    assert set(tokens.tolist()) <= set(support.tolist())  # never a token outside the kept set
    counts = np.bincount(tokens, minlength=probs.size)[support]
    if support.size == 1:
        return
    assert chisquare(counts, probs[support] / probs[support].sum() * tokens.size).pvalue > 1e-3, counts


def test_greedy_rows_take_the_argmax_whatever_the_key():
    assert set(draw_all(SamplingParams(temperature=0.0)).tolist()) == {0}
    assert set(draw_all(SamplingParams(top_k=1)).tolist()) == {0}


@pytest.mark.parametrize("temperature", [1e-30, 5e-324, 9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    # 1/T overflows float32 (inf, then inf - inf = NaN logits): what such a temperature asks for is the argmax
    with np.errstate(over="raise", invalid="raise"):
        assert set(draw_all(SamplingParams(temperature=temperature), keys=KEYS[:200]).tolist()) == {0}
    assert SampleRow(SamplingParams(temperature=temperature)).inv_temperature == 0.0


def test_plain_sampling_follows_the_distribution():
    assert_follows(draw_all(SamplingParams(temperature=1.0)), PROBS)


def test_temperature_sharpens():
    assert_follows(draw_all(SamplingParams(temperature=0.5)), PROBS**2)


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
    assert_follows(tokens, np.where(np.isin(np.arange(5), sorted(support)), PROBS, 0))


def test_a_nucleus_wider_than_the_candidates_falls_back_to_a_full_sort():
    logits = np.zeros(1000, np.float32)  # flat: top_p=0.5 keeps 500 tokens, more than 16 candidates
    tokens = draw_all(SamplingParams(top_p=0.5), logits, Sampler(np, candidates=16), KEYS[:200])
    assert len(set(tokens.tolist())) > 100


def test_rows_with_different_settings_share_one_batch():
    key = row_key(1, 0)
    rows = [SampleRow(SamplingParams(temperature=0.0), key), SampleRow(SamplingParams(top_k=2), key),
            SampleRow(SamplingParams(), key)]
    tokens, _ = Sampler(np).sample(np.tile(LOGITS, (3, 1)), rows)
    assert tokens[0] == 0 and tokens[1] in (0, 1)
    alone = [Sampler(np).sample(LOGITS[None, :], [r])[0][0] for r in rows]
    assert tokens.tolist() == alone  # a row's draw does not depend on its neighbours


def test_keys_repeat_and_differ_by_position_and_seed():
    assert row_key(7, 3) == row_key(7, 3)
    assert len({row_key(7, i) for i in range(100)}) == 100
    assert row_key(7, 3) != row_key(8, 3)
    assert row_key(-1, 0) == row_key(2**64 - 1, 0)  # seeds are taken mod 2^64


def test_the_noise_is_gumbel_and_bounded():
    g = gumbel(np, np.arange(1 << 18, dtype=np.uint32), row_key(3, 9))
    assert g.max() < NOISE_MAX
    assert abs(g.mean() - np.euler_gamma) < 0.01 and abs(g.std() - np.pi / np.sqrt(6)) < 0.01


def test_pruned_draw_equals_the_dense_draw_on_a_large_vocabulary():
    """NumPy scores only the tokens that can still win; every token scored gives the same ids."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 50_000)) * 4).astype(np.float32)
    rows = [SampleRow(SamplingParams(temperature=t), row_key(5, i)) for i, t in enumerate((1, 0.3, 2, 1, 0, 0.7))]
    ids = np.arange(logits.shape[1], dtype=np.uint32)
    dense = [int(np.argmax(logits[i] * np.float32(r.inv_temperature) + gumbel(np, ids, r.key)))
             if not r.greedy else int(np.argmax(logits[i])) for i, r in enumerate(rows)]
    assert Sampler(np).choose(logits, rows).tolist() == dense


def test_logprobs_are_the_models_log_softmax_with_sorted_alternatives():
    key = row_key(0, 0)
    rows = [SampleRow(SamplingParams(temperature=0.0), key, logprobs=3), SampleRow(SamplingParams(), key)]
    _, lps = Sampler(np).sample(np.tile(LOGITS, (2, 1)), rows)
    (entry,) = lps[0]
    assert entry.token_id == 0 and entry.logprob == pytest.approx(np.log(0.5), abs=1e-5)
    assert [t for t, _ in entry.top] == [0, 1, 2]
    assert [v for _, v in entry.top] == pytest.approx(np.log([0.5, 0.3, 0.1]).tolist(), abs=1e-5)
    assert lps[1] is None


def test_engine_rows_carry_the_packing_each_row_gives_alone():
    """Engine.sample_rows packs the device draw's parameters for the whole batch at once (SampleRows.packed);
    they are what pack_rows reads from each row by itself (key words, 1/T as float32 bits with 0 for every
    greedy form, logprobs asked), and each row's key is row_key(seed, its token index)."""
    from workers.cupy.engine import Engine
    from workers.cupy.sampler import pack_rows
    from workers.cupy.sequence import Sequence

    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
                SamplingParams(temperature=1e-30), SamplingParams(temperature=1.3, top_k=1),
                SamplingParams(temperature=2.0, top_p=0.5), SamplingParams(temperature=1e-5)]
    seqs = [Sequence(request_id=str(i), token_ids=list(range(10 + i)), max_tokens=50, sampling=p, seed=7 ** i,
                     num_prompt_tokens=5, logprobs=[None, 0, 3][i % 3]) for i, p in enumerate(settings)]
    rows = Engine.sample_rows(Engine.__new__(Engine), seqs, ahead=[0, 1, 0, 2, 0, 0, 3])
    assert rows.packed is not None
    got, alone = np.zeros((len(rows), 4), np.int32), np.zeros((len(rows), 4), np.int32)
    pack_rows(rows, got)
    pack_rows(list(rows), alone)  # a plain list: every row read by itself
    assert (got == alone).all()
    assert got[0, 2] == got[3, 2] == got[4, 2] == 0 and got[1, 2] != 0  # greedy forms draw the argmax
    assert got[:, 3].tolist() == [0, 1, 1, 0, 1, 1, 0]
    for r, s, a in zip(rows, seqs, [0, 1, 0, 2, 0, 0, 3]):
        assert r.key == row_key(s.seed, s.num_output + a) and r.params is s.sampling and r.logprobs == s.logprobs
    # what the step's rows ask, one number for the step (no row read): each row's own properties, OR-ed
    from workers.cupy.sampler import (ASK_ALTERNATIVES, ASK_LOGPROBS, ASK_PENALIZED, ASK_TRUNCATED, row_asks,
                                      rows_ask)
    for r in rows:
        bits = row_asks(r.params, r.logprobs)
        assert bool(bits & ASK_TRUNCATED) == r.truncated and bool(bits & ASK_LOGPROBS) == (r.logprobs is not None)
        assert bool(bits & ASK_ALTERNATIVES) == bool(r.logprobs) and bool(bits & ASK_PENALIZED) == r.params.penalized
    assert rows.asks == ASK_LOGPROBS | ASK_ALTERNATIVES | ASK_TRUNCATED  # top_p 0.5 at T 2; top_k 1 is greedy
    for bit in (ASK_LOGPROBS, ASK_ALTERNATIVES, ASK_TRUNCATED, ASK_PENALIZED):
        assert rows_ask(rows, bit) == rows_ask(list(rows), bit)
    plain = Engine.sample_rows(Engine.__new__(Engine), [
        Sequence(request_id="p", token_ids=[1, 2], max_tokens=5, sampling=SamplingParams(presence_penalty=0.5),
                 num_prompt_tokens=1)])
    assert plain.asks == ASK_PENALIZED and rows_ask(plain, ASK_PENALIZED) and not rows_ask(plain, ASK_TRUNCATED)
    # the same sequences a token later (the engine keeps their fixed inputs between such calls): as computed afresh
    engine = Engine.__new__(Engine)
    first = engine.sample_rows(seqs)
    for s in seqs:
        s.token_ids.append(3)
    again, fresh = engine.sample_rows(seqs), Engine.sample_rows(Engine.__new__(Engine), list(seqs))
    assert (again.packed == fresh.packed).all() and not (again.packed == first.packed).all()
    assert [r.key for r in again] == [row_key(s.seed, s.num_output) for s in seqs]
    assert [(r.params, r.logprobs) for r in again] == [(s.sampling, s.logprobs) for s in seqs]
