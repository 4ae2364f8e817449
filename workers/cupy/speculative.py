"""Speculative decoding in the engine: per step, draft up to K tokens for each decoding sequence
(drafter.py), verify every draft of the step in ONE forward over the paged KV cache, keep the accepted
prefix plus one token from the model, and roll back the rest.

K comes from policy.speculation.choose_k for every sequence at every step, with the engine's live running
count, so the depth follows the real occupancy of the batch. A step in which no sequence has a draft is an
ordinary engine step (engine.py), untouched.

Verification of a sequence whose last token sits at position P, with drafts d1..dm: the step runs the
tokens [last, d1..dm] at positions P..P+m and takes logits at all m + 1 of them. Position i's logits are
the model's distribution for the token after d1..di, so:
- greedy (temperature 0): d(i+1) is kept while it equals the argmax at position i; the first mismatch is
  replaced by that argmax; if every draft is kept, the argmax after dm is a free extra token. The output is
  exactly what one-token-at-a-time greedy decoding gives.
- sampling: the draft is a point mass (n-gram / prediction drafts carry no distribution), so d(i+1) is
  kept with probability p_i(d(i+1)), p the distribution the sampler draws from (temperature, top-k/p,
  min-p); on rejection the token is drawn from p_i with d(i+1) removed, renormalised. Each emitted token
  is then distributed exactly as p (the standard speculative sampling argument with q = a point mass).
Rollback: rejected drafts' K/V were written at positions past the kept ones; the sequence's computed
length is set to the kept tokens, so attention never reads them, later tokens overwrite them, and blocks
that only held rejected positions go back to the free list (BlockManager.truncate). Only blocks full of
kept tokens are ever hashed into the prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policy.profiles import DeviceProfile
from policy.speculation import SCHEMA, TEXT, choose_k
from workers.cupy.batch import build_batch
from workers.cupy.device import to_host
from workers.cupy.drafter import Drafter
from workers.cupy.sampler import SampleRow, uniform_for
from workers.cupy.sequence import Sequence


@dataclass
class _SeqSpec:
    drafter: Drafter
    cap: int | None  # the request's max_draft_tokens
    workload: str


class Speculator:
    """The engine's speculation: per-request drafters, the policy call, verification, and counters."""

    def __init__(self, profile: DeviceProfile):
        self.profile = profile
        self._seqs: dict[str, _SeqSpec] = {}
        width = max(profile.max_draft_tokens, 1)
        self.last_k: int | None = None  # the largest K chosen in the latest decode step
        self.steps_by_k = [0] * (profile.max_draft_tokens + 1)  # decoding sequence-steps at each K
        self.drafted_by_position = [0] * width
        self.accepted_by_position = [0] * width

    def attach(self, seq: Sequence, request) -> None:
        workload = SCHEMA if request.grammar is not None else TEXT
        drafter = Drafter(request.prediction_ids, seq.num_prompt_tokens)
        self._seqs[seq.request_id] = _SeqSpec(drafter, request.max_draft_tokens, workload)

    # --- drafting ----------------------------------------------------------------------------------
    def propose(self, engine, scheduled: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """{batch index: draft} for this step's decoding sequences; their KV blocks are allocated."""
        for rid in [r for r in self._seqs if r not in engine.seqs]:  # finished or aborted since
            del self._seqs[rid]
        running = len(engine.scheduler.running)
        budget = engine.scheduler.max_step_tokens - sum(n for _, n in scheduled)
        drafts, ks = {}, []
        for b, (seq, n) in enumerate(scheduled):
            spec = self._seqs.get(seq.request_id)
            if spec is None or n != 1 or seq.num_remaining != 1:
                continue  # only sequences decoding their next token draft (not prefill chunks)
            k = choose_k(len(seq.token_ids), running, spec.workload, self.profile, spec.cap)
            ks.append(k)
            # drafts past the token limit could never be emitted; the step's token budget bounds its time
            k = min(k, seq.max_tokens - seq.num_output - 1, budget)
            draft = spec.drafter.propose(seq.token_ids, k) if k > 0 else []
            if draft and engine.constraints is not None:
                draft = draft[: engine.constraints.cut_drafts(seq.request_id, draft)]
            while draft and not engine.blocks.can_allocate(seq, 1 + len(draft)):
                draft.pop()  # drafts never preempt anyone: verify fewer
            if draft:
                engine.blocks.allocate(seq, 1 + len(draft))
                drafts[b] = draft
                budget -= len(draft)
        for k in ks:
            self.steps_by_k[min(k, len(self.steps_by_k) - 1)] += 1
        if ks:
            self.last_k = max(ks)
        return drafts

    # --- verification ------------------------------------------------------------------------------
    def verify(self, engine, scheduled: list[tuple[Sequence, int]], drafts: dict[int, list[int]]):
        """Run the step with every draft in it; returns (outputs, prefilled token count)."""
        runs = [(seq, n + len(drafts.get(b, []))) for b, (seq, n) in enumerate(scheduled)]
        batch = build_batch(runs, engine.blocks.block_size, engine.model.xp, drafts)
        logits = engine.model.forward(batch, engine.kv)
        plain_rows, plain_seqs, draft_rows, draft_groups = [], [], [], []
        row = 0
        for b, (seq, n) in enumerate(scheduled):
            if b in drafts:
                draft_groups.append((seq, drafts[b]))
                draft_rows += range(row, row + 1 + len(drafts[b]))
                row += 1 + len(drafts[b])
                continue
            seq.num_computed += n  # as in a plain step: the whole chunk is now in the cache
            engine.blocks.commit_full_blocks(seq)
            if row < len(batch.sample_rows) and batch.sample_rows[row] == b:
                plain_rows.append(row)
                plain_seqs.append(seq)
                row += 1
        xp = engine.sampler.xp
        outputs = []
        if plain_rows:  # sequences without a draft sample exactly as in a plain step
            outputs += engine._sample(logits[xp.asarray(np.asarray(plain_rows))], plain_seqs)
        if draft_groups:
            outputs += self._accept(engine, logits, draft_rows, draft_groups)
        return outputs, batch.num_tokens - len(batch.sample_rows)

    def _accept(self, engine, step_logits, rows: list[int], groups: list[tuple[Sequence, list[int]]]):
        """Accept/reject each group's drafts (its rows of `step_logits` are consecutive in `rows`), then
        update it."""
        constraints = engine.constraints
        masked = constraints is not None and any(s.request_id in constraints for s, _ in groups)
        chosen = _step_argmax(engine, step_logits)
        if chosen is not None and not masked and all(_greedy(s) and s.logprobs is None for s, _ in groups):
            # greedy and unconstrained: the argmax the model's step already took (GPU graphs) is all it needs
            return self._accept_groups(engine, None, None, chosen[np.asarray(rows)], groups)
        logits = step_logits[engine.sampler.xp.asarray(np.asarray(rows))]
        raw = logits
        if masked:
            ids = [seq.request_id for seq, d in groups for _ in range(len(d) + 1)]
            if any(s.logprobs is not None and s.request_id in constraints for s, _ in groups):
                raw = logits.copy()  # logprobs report the model's own distribution, not the masked one
            logits = constraints.apply_drafts(logits, ids, {s.request_id: d for s, d in groups})
        argmax = to_host(engine.sampler.xp.argmax(logits, axis=1))
        return self._accept_groups(engine, logits, raw, argmax, groups)

    def _accept_groups(self, engine, logits, raw, argmax: np.ndarray, groups: list[tuple[Sequence, list[int]]]):
        outputs, row = [], 0
        for seq, draft in groups:
            width = len(draft) + 1
            if _greedy(seq):
                emitted, kept = _accept_greedy(draft, argmax[row : row + width].tolist())
            else:
                emitted, kept = _accept_sampled(engine, seq, draft, logits[row : row + width])
            self._count(seq, draft, kept)
            emitted = _cut_at_stop(seq, emitted)
            seq.num_accepted += min(kept, len(emitted))  # drafts past a stop are kept but not emitted
            outputs.append(self._emit(engine, seq, emitted, raw, row))
            row += width
        return outputs

    def _count(self, seq: Sequence, draft: list[int], kept: int) -> None:
        for i in range(min(len(draft), len(self.drafted_by_position))):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < kept
        seq.num_drafted += len(draft)

    def _emit(self, engine, seq: Sequence, emitted: list[int], raw, row: int):
        """Roll `seq` forward by the emitted tokens: all but the last already have K/V from this step."""
        lps = None
        if seq.logprobs is not None:
            rows = [SampleRow(seq.sampling, 0.0, seq.logprobs)] * len(emitted)
            per_row = engine.sampler._logprobs(raw[row : row + len(emitted)], np.asarray(emitted), rows)
            lps = [lp for entry in per_row for lp in entry]
        seq.token_ids.extend(emitted[:-1])
        seq.num_computed = len(seq.token_ids)  # the last known token's K/V is the next step's to compute
        engine.blocks.commit_full_blocks(seq)
        engine.blocks.truncate(seq, seq.num_computed + 1)
        if engine.constraints is not None:
            engine.constraints.advance([seq.request_id] * len(emitted), emitted)
        engine.append_token(seq, emitted[-1])  # finishes it on a stop token or at its limit
        return engine.output_for(seq, emitted, lps)


def _step_argmax(engine, step_logits) -> np.ndarray | None:
    """Host argmax ids of every row of `step_logits` when the model computed them inside its step (the GPU
    model's graphs do; `last_chosen` belongs to exactly the logits its forward returned), else None."""
    model = engine.model
    chosen = getattr(model, "last_chosen", None)
    if chosen is None or step_logits is not getattr(model, "last_logits", None) or chosen.shape[0] != step_logits.shape[0]:
        return None
    return to_host(chosen)


def _greedy(seq: Sequence) -> bool:
    return seq.sampling.temperature <= 0 or seq.sampling.top_k == 1


def _accept_greedy(draft: list[int], targets: list[int]) -> tuple[list[int], int]:
    """(emitted tokens, drafts kept): drafts while they match the model's argmax, then its own token."""
    kept = 0
    while kept < len(draft) and draft[kept] == targets[kept]:
        kept += 1
    return draft[:kept] + [targets[kept]], kept


def _accept_sampled(engine, seq: Sequence, draft: list[int], logits) -> tuple[list[int], int]:
    """Rejection sampling against a point-mass draft (module docstring); draws are seeded per token."""
    xp, params = engine.sampler.xp, seq.sampling
    rows = [SampleRow(params, 0.0)] * (len(draft) + 1)
    kept_probs = engine.sampler.truncated_probs(logits, rows, np.full(len(rows), params.temperature, np.float32))
    totals = to_host(kept_probs.sum(axis=1))
    p_draft = to_host(kept_probs[xp.arange(len(draft)), xp.asarray(np.asarray(draft))]) / totals[: len(draft)]
    for i, token in enumerate(draft):
        index = seq.num_output + i  # the generated-token index this position fills
        if _accept_uniform(params.seed, index, engine.rng) < p_draft[i]:
            continue
        residual = kept_probs[i].copy()
        residual[token] = 0
        return draft[:i] + [_draw(xp, residual, uniform_for(params.seed, index, engine.rng))], i
    bonus = uniform_for(params.seed, seq.num_output + len(draft), engine.rng)
    return draft + [_draw(xp, kept_probs[len(draft)], bonus)], len(draft)


def _accept_uniform(seed: int | None, index: int, rng: np.random.Generator) -> float:
    """The accept/reject draw for a token index: its own stream, apart from the token draws."""
    if seed is None:
        return float(rng.random())
    return float(np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, index, 1]).random())


def _draw(xp, weights, u: float) -> int:
    """Inverse-CDF draw from unnormalised `weights` (one row), as the sampler draws."""
    cdf = xp.cumsum(weights)
    return int(min(int((cdf <= u * cdf[-1]).sum()), weights.shape[0] - 1))


def _cut_at_stop(seq: Sequence, emitted: list[int]) -> list[int]:
    """The emitted tokens up to and including the first stop token or the one that reaches max_tokens."""
    for j, token in enumerate(emitted):
        if token in seq.stop_token_ids or seq.num_output + j + 1 >= seq.max_tokens:
            return emitted[: j + 1]
    return emitted
