"""OpenAI's presence and frequency penalties in Pulse's engine (NumPy path, the bundled model): the arithmetic,
and greedy decoding on the real model choosing the penalized argmax at every step, with other sequences in the
same batch untouched and no drafting for the penalized one."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.integration.engine_helpers import encode, make_engine
from tests.integration.engine_helpers import run as generate
from tests.integration.test_speculation import always
from workers.cupy.engine import apply_penalties
from workers.cupy.sequence import Sequence
from workers.cupy.speculative import Speculator
from workers.protocol import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

# a prompt the model continues by repeating itself: unpenalized greedy says "the cat" again and again
PROMPT = "the cat the cat the cat the cat the cat the cat the cat the cat"
PENALIZED = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5)


def test_the_arithmetic_counts_the_output_only():
    seqs = [Sequence(request_id="a", token_ids=[5, 6, 5, 7, 5], max_tokens=9, sampling=PENALIZED, num_prompt_tokens=2),
            Sequence(request_id="b", token_ids=[5, 5, 5], max_tokens=9, sampling=SamplingParams(), num_prompt_tokens=1)]
    logits = np.zeros((2, 10), np.float32)
    apply_penalties(np, logits, seqs)
    # output of "a": 5 twice, 7 once (the prompt's 5 and 6 do not count); "b" asked for nothing
    expected = np.zeros((2, 10), np.float32)
    expected[0, 5] = -(2 * 1.5 + 0.5)
    expected[0, 7] = -(1 * 1.5 + 0.5)
    np.testing.assert_allclose(logits, expected)


def assert_penalized_argmax(tokens: list[int], entries, s: SamplingParams, tolerance: float) -> int:
    """Each greedy token is the best of its top logprobs less the penalties of the output before it (within
    `tolerance`); returns how many steps the penalty overturned the model's own first choice."""
    counts: Counter = Counter()
    changed = 0
    for token, entry in zip(tokens, entries, strict=True):
        assert entry.token_id == token
        scores = {t: lp - counts[t] * s.frequency_penalty - (counts[t] > 0) * s.presence_penalty for t, lp in entry.top}
        assert token in scores and scores[token] >= max(scores.values()) - tolerance, (token, scores)
        changed += token != entry.top[0][0]
        counts[token] += 1
    return changed


def test_greedy_takes_the_penalized_argmax_beside_an_untouched_sequence():
    ids = encode(PROMPT)
    reference, _ = generate(make_engine(), [ids], 24)  # unpenalized, alone
    engine = make_engine()
    engine.speculator = Speculator(always(4))  # would draft from the prompt's repetition if allowed
    finals = []
    engine.add(GenerateRequest(request_id="p", prompt_ids=ids, max_tokens=24, sampling=PENALIZED, logprobs=20,
                               ignore_eos=True))
    engine.add(GenerateRequest(request_id="u", prompt_ids=ids, max_tokens=24, sampling=SamplingParams(temperature=0.0),
                               ignore_eos=True, max_draft_tokens=0))
    got = {"p": [], "u": []}
    entries = []
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.token_ids
            if out.request_id == "p":
                entries += out.logprobs
                if out.finish_reason:
                    finals.append(out)
    assert got["u"] == reference[0]  # the other row of the batch is untouched
    assert len(got["p"]) == 24 and finals and finals[0].drafted_tokens == 0
    changed = assert_penalized_argmax(got["p"], entries, PENALIZED, 1e-4)
    assert changed > 0
    assert max(Counter(got["p"]).values()) < max(Counter(reference[0]).values())
