"""A speculative verify step samples its drafted rows with the very rows it staged before its forward.

The GPU sampler trusts the draws its step's kernel made only for the rows it staged (GpuSampler._drawn_in_step:
the same SampleRow objects, or equal ones); rows built again for the acceptance cost a second pass and, were they
ever to differ, would send every verify step down the eager path (the logits copied and sampled again). Here a
sampler double records what was staged and what each sample call gets, over an engine whose model copies a
file, so every step after the first drafts."""
from __future__ import annotations

import numpy as np

from policy.profiles import DeviceProfile, SpeculationRule
from workers.cupy.engine import Engine
from workers.cupy.kv_cache import BlockManager
from workers.cupy.sampler import Sampler
from workers.cupy.scheduler import Scheduler
from workers.cupy.speculative import Speculator
from workers.protocol import GenerateRequest, SamplingParams

VOCAB = 512
FILE = [2 + (i * 37) % 500 for i in range(200)]  # 200 distinct ids: the "file" the model copies out


class CopyModel:
    """Logits whose argmax after each token is the token that follows it in FILE."""

    xp = np

    def __init__(self):
        self.next = dict(zip(FILE, FILE[1:]))

    def forward(self, batch, kv):
        rows = np.asarray(batch.logits_indices)
        out = np.zeros((rows.size, VOCAB), np.float32)
        out[np.arange(rows.size), [self.next.get(int(t), 7) for t in np.asarray(batch.token_ids)[rows]]] = 1.0
        return out


class RecordingSampler(Sampler):
    def __init__(self):
        super().__init__(np)
        self.staged = None
        self.calls = []  # (staged rows, index, rows) per sample call

    def stage(self, rows):
        self.staged = rows

    def sample(self, logits, rows, index=None):
        self.calls.append((self.staged, index, list(rows)))
        return super().sample(logits, rows, index)


def test_drafted_rows_are_sampled_with_the_rows_staged_for_the_step():
    blocks = BlockManager(1024, 16)
    sampler = RecordingSampler()
    eng = Engine(CopyModel(), None, blocks, Scheduler(blocks, 4, 1024), sampler, (1,), 1 << 16, VOCAB, 0, True)
    eng.speculator = Speculator(DeviceProfile(name="k8", max_draft_tokens=8, speculation_gate=False,
                                              speculation=[SpeculationRule(max_context=10**9, k=8)]))
    eng.add(GenerateRequest(request_id="r", prompt_ids=[*FILE, 1, *FILE[:4]], max_tokens=64, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.0)))
    out = []
    while eng.has_work():
        out += [t for o in eng.step() for t in o.token_ids]
    assert out == FILE[4:68]  # the copy, whole: every kept draft was the model's own token
    verified = [(staged, index, rows) for staged, index, rows in sampler.calls if index is not None and len(rows) > 1]
    assert len(verified) >= 64 // 9  # steps of up to 8 drafts and the model's token
    for staged, index, rows in verified:
        assert all(staged[i] is r for i, r in zip(index, rows))
