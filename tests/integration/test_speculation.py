"""Speculative decoding on the real model (NumPy path): lossless at temperature 0, distribution-preserving
at temperature > 0, counters right.

The reference for every comparison is the same engine with speculation off for the request
(max_draft_tokens=0, which is also the request-cap path). Prompts are code-editing prompts, where prompt
lookup drafts a lot, and plain ones, where it drafts little; K varies; blocks are small so drafts cross
block boundaries; one prompt runs past the 512-token sliding window.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cache.hashing import chain_hashes
from policy.profiles import DeviceProfile, SpeculationRule
from tests.integration.engine_helpers import PROMPTS, encode, make_engine
from tests.integration.engine_helpers import run as generate
from workers.cupy import speculative
from workers.cupy.speculative import Speculator
from workers.protocol import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
SOURCE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def describe(width, height):
    return f"{width}x{height}: area {area(width, height)}"
'''
EDIT = ("<start_of_turn>user\nRename the parameter `width` to `w` everywhere in this file and output the whole "
        f"file:\n```python\n{SOURCE}```<end_of_turn>\n<start_of_turn>model\n```python\n")


def always(k: int) -> DeviceProfile:
    """A profile that asks for K = k at any context and concurrency (drafts cost nothing, so the
    acceptance-aware depth keeps the cap: these tests pin K)."""
    return DeviceProfile(name=f"k{k}", max_draft_tokens=k, speculation=[SpeculationRule(max_context=10**9, k=k)],
                         draft_token_cost=0.0)


def spec_engine(k: int, **kw):
    engine = make_engine(**kw)
    engine.speculator = Speculator(always(k))
    return engine


@pytest.fixture(scope="module")
def prompts():
    return [encode(EDIT), encode(PROMPTS[1]), encode(PROMPTS[0])]


@pytest.fixture(scope="module")
def reference(prompts):
    tokens, _ = generate(spec_engine(4), prompts, 24, max_draft_tokens=0)
    return tokens


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_tokens_are_identical_with_speculation(prompts, reference, k):
    events = []
    engine = spec_engine(k, block_size=4, num_blocks=128, block_sink=events.append)  # drafts cross blocks
    tokens, finals = generate(engine, prompts, 24)
    assert tokens == reference
    spec = engine.speculator
    # the code edit drafts (the file is in the prompt) and keeps some of it
    assert finals[0].drafted_tokens > 0 and finals[0].accepted_tokens > 0
    assert all(0 <= f.accepted_tokens <= f.drafted_tokens for f in finals)
    assert sum(f.drafted_tokens for f in finals) == sum(spec.drafted_by_position)
    assert len(spec.drafted_by_position) == k
    assert all(a <= d for a, d in zip(spec.accepted_by_position, spec.drafted_by_position))
    assert spec.last_k == k and spec.steps_by_k[k] > 0
    # rolled-back drafts never reach the prefix cache: every hash added is a block of the real tokens
    root = engine.blocks.root.hash
    real = {h for p, t in zip(prompts, tokens) for h in chain_hashes(p + t, 4, root)}
    added = {h for e in events if e.kind == "added" for h in e.hashes}
    assert added and added <= real
    assert engine.blocks.num_used == 0


def test_draft_crossing_a_stop_token_stops_where_plain_decoding_stops(prompts, reference):
    # stop on a token the edit reproduces from the prompt, so drafts run over it
    stop = reference[0][10]
    cut = reference[0].index(stop) + 1
    engine = spec_engine(4)
    (plain,), _ = generate(engine, prompts[:1], 24, tag="p", ignore_eos=False, stop_token_ids=[stop],
                           max_draft_tokens=0)
    (spec,), (final,) = generate(engine, prompts[:1], 24, tag="s", ignore_eos=False, stop_token_ids=[stop])
    assert plain == spec == reference[0][:cut]
    assert final.finish_reason == "stop" and final.completion_tokens == cut
    assert final.drafted_tokens > 0


def test_max_tokens_inside_a_draft_ends_with_length(prompts, reference):
    for n in (1, 2, 7):
        (tokens,), (final,) = generate(spec_engine(4), prompts[:1], n, tag=f"m{n}")
        assert tokens == reference[0][:n] and final.finish_reason == "length" and final.completion_tokens == n


def test_predicted_outputs_draft_from_the_prediction_and_change_nothing(prompts, reference):
    prediction = encode(SOURCE)[1:]  # the original file: most of the answer
    engine = spec_engine(4)
    (tokens,), (final,) = generate(engine, prompts[:1], 24, prediction_ids=prediction)
    assert tokens == reference[0]
    assert final.accepted_tokens >= 8  # the answer copies the file, so most drafts hold


def test_past_the_sliding_window(prompts):
    # ~490 prompt tokens of repeated code: drafts are verified at positions across 512 (local layers'
    # window), and the cached prompt is reused by the second run
    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(32))
    ids = encode(text)
    assert 480 < len(ids) < 512, len(ids)
    engine = spec_engine(4, max_step_tokens=1024)
    (plain,), _ = generate(engine, [ids], 40, tag="p", max_draft_tokens=0)
    (spec,), (final,) = generate(engine, [ids], 40, tag="s")
    assert spec == plain
    assert len(ids) + 40 > 512 + 8
    assert final.accepted_tokens > 0 and final.cached_tokens > 0


def test_constrained_decoding_with_speculation_is_lossless():
    from workers.cupy.constrain import Constraints, GrammarCompiler
    from workers.protocol.model import load_model_info, load_tokenizer

    info = load_model_info(None)
    compiler = GrammarCompiler(load_tokenizer(None), info.vocab_size, info.eos_token_ids)
    schema = ('{"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", '
              '"enum": ["alpha", "beta"]}}}, "required": ["items"]}')
    prompt = encode('<start_of_turn>user\nOutput {"items": ["alpha", "beta", "alpha", "beta", "alpha", "beta", '
                    '"alpha"]} as JSON.<end_of_turn>\n<start_of_turn>model\n')
    engine = spec_engine(3)
    engine.constraints = Constraints(compiler, np)
    (plain,), _ = generate(engine, [prompt], 20, tag="p", grammar=schema, max_draft_tokens=0, ignore_eos=False)
    (spec,), (final,) = generate(engine, [prompt], 20, tag="s", grammar=schema, ignore_eos=False)
    assert spec == plain
    assert final.drafted_tokens > 0


def test_sampling_keeps_the_distribution(prompts):
    """Seeded samples of the 2nd and 3rd tokens (the first ones speculation decides) with and without
    speculation: the same distribution (chi-square on each position's counts)."""
    from scipy.stats import chi2_contingency

    prompt = encode("one two three four one two three four one two three four one two")
    n = 48
    counts = {}
    for arm, cap, seed in (("plain", 0, 1000), ("spec", None, 5000)):  # independent seeds per arm
        engine = spec_engine(3, max_num_seqs=n, num_blocks=n * 3, max_step_tokens=n * 24)
        for i in range(n):
            sampling = SamplingParams(temperature=1.0, top_k=4, seed=seed + i)
            engine.add(GenerateRequest(request_id=f"{arm}{i}", prompt_ids=prompt, max_tokens=3, ignore_eos=True,
                                       sampling=sampling, max_draft_tokens=cap))
        out = {f"{arm}{i}": [] for i in range(n)}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.token_ids
        counts[arm] = [Counter(t[pos] for t in out.values()) for pos in (1, 2)]
        if arm == "spec":
            assert sum(engine.speculator.accepted_by_position) > 0
            assert sum(engine.speculator.drafted_by_position) > sum(engine.speculator.accepted_by_position)
    for pos in (0, 1):
        seen = sorted(set(counts["plain"][pos]) | set(counts["spec"][pos]))
        table = [[counts[arm][pos][t] for t in seen] for arm in ("plain", "spec")]
        assert len(seen) >= 2, counts  # the setting must leave room for more than one token
        assert chi2_contingency(table).pvalue > 0.001, counts


def test_seeded_sampling_is_batch_and_speculation_invariant(prompts, monkeypatch):
    """A seeded request at temperature 1 gives the same tokens alone, batched with another request, and
    with speculation verifying drafts: every draw is keyed by (seed, token index). Every step searches for a
    draft here (no wait after a failed search), so that 12 tokens of sampled text see verify steps."""
    monkeypatch.setattr(speculative, "MISS_WAIT_MAX", 0)
    sampling = SamplingParams(temperature=1.0, seed=42)
    alone, _ = generate(spec_engine(4), prompts[:1], 12, sampling=sampling, max_draft_tokens=0)
    batched, _ = generate(spec_engine(4), prompts[1:2] + prompts[:1], 12, sampling=sampling, max_draft_tokens=0)
    spec, finals = generate(spec_engine(4), prompts[:2], 12, sampling=sampling)
    assert alone[0] == batched[1] == spec[0]
    assert finals[0].drafted_tokens > 0


def test_a_finished_sequence_teaches_its_kinds_prior(prompts):
    """The engine's speculator hands a finished sequence's acceptance to the prior its kind's next sequences
    start from (policy.speculation.AcceptancePrior): sampled text here, not greedy, not a prediction's."""
    from policy.speculation import PRIOR

    engine = spec_engine(4)
    spec = engine.speculator
    _, finals = generate(engine, prompts[:1], 12, sampling=SamplingParams(temperature=1.0, seed=7))
    assert finals[0].drafted_tokens > 0
    generate(engine, prompts[1:2], 4, tag="s")  # the next request's steps find the first one gone
    learned = spec.prior.snapshot()
    assert list(learned) == [str(("text", True, False))]
    assert spec.prior.start(("text", True, False)).rates != [PRIOR] * 16
    assert spec.prior.start(("text", False, False)).rates == [PRIOR] * 16


def test_every_sampled_row_was_staged_before_its_forward(prompts, monkeypatch):
    """The device sampler's contract (workers/cupy/gpu GpuSampler draws inside the step): the rows the engine
    samples, in plain and verify steps alike, are exactly the rows it staged before that step's forward, at
    the same logits rows. Checked here with the NumPy sampler, recording (every step searching for a draft)."""
    monkeypatch.setattr(speculative, "MISS_WAIT_MAX", 0)
    from workers.cupy.sampler import Sampler

    class Recording(Sampler):
        staged, mismatches, calls = None, 0, 0

        def stage(self, rows):
            self.staged = list(rows)

        def sample(self, logits, rows, index=None):
            sel = range(len(rows)) if index is None else index
            self.calls += 1
            self.mismatches += any(self.staged[i] != r for i, r in zip(sel, rows)) or len(self.staged) != logits.shape[0]
            return super().sample(logits, rows, index)

    engine = spec_engine(4)
    engine.sampler = Recording(np)
    _, finals = generate(engine, prompts[:2], 12, sampling=SamplingParams(temperature=1.0, seed=42))
    assert finals[0].drafted_tokens > 0  # verify steps ran
    assert engine.sampler.calls > 0 and engine.sampler.mismatches == 0


async def test_backend_stop_strings_usage_and_stats(prompts):
    """Through EngineBackend (the cpu profile's policy): a stop string inside accepted drafts cuts the text
    where plain decoding cuts it; usage carries drafted/accepted; stats carry the per-position counters."""
    from policy.config import PulseConfig
    from policy.profiles import builtin_profiles
    from workers.cupy.backend import EngineBackend
    from workers.protocol.model import load_model_info

    config = PulseConfig.model_validate({"workers": {"engine": {"kv_blocks": 64, "max_num_seqs": 2}}})
    backend = EngineBackend(config, builtin_profiles()["cpu"], load_model_info(None))
    await backend.start()
    try:
        async def text(rid, **kw):
            chunks = [c async for c in backend.generate(GenerateRequest(
                request_id=rid, prompt_ids=prompts[0], max_tokens=24, sampling=GREEDY, ignore_eos=True, **kw))]
            return "".join(c.text for c in chunks), chunks[-1]

        full, _ = await text("full", max_draft_tokens=0)
        stop = full[30:36]
        plain, plain_last = await text("plain", stop=[stop], max_draft_tokens=0)
        spec, spec_last = await text("spec", stop=[stop])
        assert plain == spec == full[: full.index(stop)]
        assert plain_last.finish_reason == spec_last.finish_reason == "stop"
        assert plain_last.usage.drafted_tokens == 0
        assert spec_last.usage.drafted_tokens >= spec_last.usage.accepted_tokens > 0
        # prompt-lookup drafts are Pulse's own counters, never prediction tokens
        assert spec_last.usage.accepted_prediction_tokens == spec_last.usage.rejected_prediction_tokens == 0
        # a prediction the completion reproduces exactly: every one of its tokens accepted (OpenAI's meaning)
        ids = [t for c in [c async for c in backend.generate(GenerateRequest(
            request_id="ids", prompt_ids=prompts[0], max_tokens=24, sampling=GREEDY, ignore_eos=True))]
            for t in c.token_ids]
        _, pred_last = await text("pred", prediction_ids=ids)
        assert (pred_last.usage.accepted_prediction_tokens, pred_last.usage.rejected_prediction_tokens) == (24, 0)
        _, half_last = await text("half", prediction_ids=ids[:12] + [0] * 12)
        assert half_last.usage.accepted_prediction_tokens == 12
        stats = backend.stats()
        assert stats.speculation_k == 4 and stats.steps_by_k[4] > 0 and stats.steps_by_k[0] > 0
        assert sum(stats.accepted_by_position) > 0 and len(stats.drafted_by_position) == 4
    finally:
        await backend.close()


def test_the_gate_times_real_steps_in_both_modes_and_changes_no_token(prompts, reference):
    """With the gate (what `pulse serve` runs), the engine's decode steps are timed with drafting on and
    off in alternating epochs; tokens are the reference's whatever the mode; a request's prediction still
    drafts while the gate has drafting from the context off."""
    from policy.speculation import SpeculationGate

    engine = spec_engine(4)
    spec = engine.speculator
    spec.gate = SpeculationGate(epoch_steps=2, explore_every=2)
    tokens, finals = generate(engine, prompts, 24)
    assert tokens == reference
    bucket = spec.gate.snapshot()[2]  # 3 sequences decoding: the 2-3 bucket
    assert bucket["on"] > 0 and bucket["off"] > 0  # real step timings, tokens per second
    assert finals[0].drafted_tokens > 0

    engine = spec_engine(4)
    spec = engine.speculator
    spec.gate = SpeculationGate(epoch_steps=1, explore_every=2)
    spec.gate._state(1).drafting = False  # as if drafting had measured slower for one stream
    spec.gate._state(1).rate = {True: 1.0, False: 2.0}
    (tokens,), (final,) = generate(engine, prompts[:1], 24, prediction_ids=encode(SOURCE)[1:])
    assert tokens == reference[0]
    assert final.accepted_tokens >= 8


def test_no_rule_drafting_at_this_concurrency_skips_drafting_and_counts_k0(prompts, reference):
    """A table that drafts only up to 2 running sequences: three at once never draft (the per-sequence work is
    skipped, Speculator.may_draft), their steps count at K 0, and the tokens are the reference's; one alone
    drafts the code edit."""
    profile = DeviceProfile(name="k4-to-2", max_draft_tokens=4, draft_token_cost=0.0,
                            speculation=[SpeculationRule(max_context=10**9, max_concurrency=2, k=4),
                                         SpeculationRule(max_context=10**9, k=0)])
    engine = make_engine()
    engine.speculator = spec = Speculator(profile)
    assert not spec.may_draft(3) and spec.may_draft(2)
    tokens, finals = generate(engine, prompts, 24)
    assert tokens == reference
    assert spec.steps_by_k[0] > 0 and sum(spec.steps_by_k[1:]) == 0 and spec.last_k == 0
    assert all(f.drafted_tokens == 0 for f in finals)
    (alone,), (final,) = generate(engine, prompts[:1], 24, tag="alone")
    assert alone == reference[0] and final.drafted_tokens > 0
