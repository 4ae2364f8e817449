"""Speculative decoding in the engine: per step, draft up to K tokens for each decoding sequence
(drafter.py), verify every draft of the step in ONE forward over the paged KV cache, keep the accepted
prefix plus one token from the model, and roll back the rest.

K is chosen for every sequence at every step, with the engine's live running count, so the depth
follows the real occupancy of the batch. A step in which no sequence has a draft is an
ordinary engine step (engine.py), untouched.

Verification of a sequence whose last token sits at position P, with drafts d1..dm: the step runs the
tokens [last, d1..dm] at positions P..P+m and takes logits at all m + 1 of them. Position i's logits are
the model's distribution for the token after d1..di. The sampler draws the token at every position with the draw keyed for that token (seed, index:
sampler.py); d(i+1) is kept while it equals the draw at position i, the first mismatch is replaced by
that draw, and if every draft is kept the draw after dm is a free extra token. Greedy rows draw the
argmax, so the output is exactly what one-token-at-a-time greedy decoding gives; sampled rows emit
exactly the tokens plain sampling would have drawn. That is rejection sampling against a point-mass
draft (n-gram / prediction drafts carry no distribution) with coupled draws: d(i+1) is kept with
probability p_i(d(i+1)), and on rejection the token follows p_i with d(i+1) removed, renormalised.

The depth each sequence drafts at comes from the profile's table (policy.speculation.choose_k) and
that sequence's own acceptance so far (choose_depth): drafts that stop paying fall to 0, with a probe
now and then. Above both, the worker's SpeculationGate (policy/speculation.py) times decode steps with
prompt-lookup drafting on and off at each concurrency and turns it off where it measured slower; a
request's own prediction (Predicted Outputs) drafts in either mode.

Rollback: rejected drafts' K/V were written at positions past the kept ones; the sequence's computed
length is set to the kept tokens, so attention never reads them, later tokens overwrite them, and blocks
that only held rejected positions go back to the free list (BlockManager.truncate). Only blocks full of
kept tokens are ever hashed into the prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass

from policy.profiles import DeviceProfile
from policy.speculation import (SCHEMA, TEXT, Acceptance, AcceptancePrior, SpeculationGate, choose_depth, choose_k,
                               next_depth)
from workers.cupy.batch import build_batch
from workers.cupy.drafter import Drafter
from workers.cupy.sequence import Sequence


# After a prompt-lookup search finds nothing, a sequence waits 1, 2, 4, then MISS_WAIT_MAX steps (doubling with each
# search in a row that fails) before it searches again: the steps between draft nothing whatever their tokens are, so
# they are launched ahead (engine.py, overlap) instead of one at a time. In novel text most searches fail; each such
# step drafted nothing and still lost the overlap. Replayed on the bundled model's own outputs for the served prompts
# (4 x 160 tokens each, the CPU engine's exact draws; K 8; a step costing 0.88 ms overlapped, 1.10 one at a time,
# 1.95 to verify, the H100's served figures of 2026-12-07: an estimate, not a GPU run), against searching every
# step: greedy code edits 3.21 -> 3.27x of no speculation, temperature 1 code edits 1.01 -> 1.12x, greedy story
# 2.07 -> 2.11x, temperature 1 story 0.76 -> 0.96x (BENCHMARKS.md, issue 19).
MISS_WAIT_MAX = 8


def miss_wait(misses: int, cap: int) -> int:
    """Steps to wait before the next search after `misses` failed searches in a row: 1, 2, 4, ... up to `cap`."""
    return min(1 << (misses - 1), cap) if misses else 0


@dataclass
class _SeqSpec:
    drafter: Drafter
    cap: int | None  # the request's max_draft_tokens
    workload: str
    acceptance: Acceptance  # this sequence's online acceptance by draft position
    kind: tuple  # (workload, sampled, drafts from a given prediction): whose acceptance it starts from
    misses: int = 0  # prompt-lookup searches in a row that found nothing
    wait: int = 0  # steps left before the next search (MISS_WAIT_MAX)


class Speculator:
    """The engine's speculation: per-request drafters, the policy call, verification, and counters."""

    def __init__(self, profile: DeviceProfile, gate: bool = False):
        """`gate`: time decode steps and draft from the context only where that measured faster
        (SpeculationGate); the backend turns it on from the profile (`speculation_gate`)."""
        self.profile = profile
        self.gate = SpeculationGate() if gate else None
        self._timed: tuple[int, bool] | None = None  # (running, drafting mode) of the step being timed
        self._seqs: dict[str, _SeqSpec] = {}
        self.prior = AcceptancePrior()  # a new sequence's acceptance starts from its kind's recent ones
        width = max(profile.max_draft_tokens, 1)
        self.last_k: int | None = None  # the largest K chosen in the latest decode step
        self.steps_by_k = [0] * (profile.max_draft_tokens + 1)  # decoding sequence-steps at each K
        self.drafted_by_position = [0] * width
        self.accepted_by_position = [0] * width
        self._may_draft: dict[int, bool] = {}  # running count -> whether any table rule drafts there
        self._skip: tuple = ([], None, 0)  # skip_drafts' latest yes, for skipped() to count once it is launched

    def attach(self, seq: Sequence, request) -> None:
        workload = SCHEMA if request.grammar is not None else TEXT
        drafter = Drafter(request.prediction_ids, seq.num_prompt_tokens)
        # a penalized sequence never drafts: its logits change with every token it emits, which the verify
        # rows (all computed in one step) would not see
        cap = 0 if request.sampling.penalized else request.max_draft_tokens
        kind = (workload, not request.sampling.greedy, bool(drafter.prediction.size))
        self._seqs[seq.request_id] = _SeqSpec(drafter, cap, workload, self.prior.start(kind), kind)

    # --- drafting ----------------------------------------------------------------------------------
    def _decodes(self, seq: Sequence, n: int) -> bool:
        """Whether `seq`, scheduled for `n` tokens, decodes its next token this step (not a prefill chunk) with
        speculation attached: only those draft, and only those count in steps_by_k."""
        return n == 1 and seq.num_remaining == 1 and seq.request_id in self._seqs

    def propose(self, engine, scheduled: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """{batch index: draft} for this step's decoding sequences; their KV blocks are allocated."""
        self._forget_ended(engine)
        running = len(engine.scheduler.running)
        if not self.may_draft(running):  # no rule drafts at this concurrency: K is 0 for every sequence
            self._timed = None
            decoding = sum(1 for seq, n in scheduled if self._decodes(seq, n))
            if decoding:
                self.steps_by_k[0] += decoding
                self.last_k = 0
            return {}
        budget = engine.scheduler.max_step_tokens - sum(n for _, n in scheduled)
        decoding = [not seq.sampling.greedy for seq, n in scheduled if n == 1]
        sampled = 2 * sum(decoding) > len(decoding)  # the gate keeps sampled batches' books apart
        mode = self.gate.drafting(running, sampled) if self.gate is not None else True
        drafts, ks, eligible = {}, [], False
        for b, (seq, n) in enumerate(scheduled):
            if not self._decodes(seq, n):
                continue
            spec = self._seqs[seq.request_id]
            cap = choose_k(len(seq.token_ids), running, spec.workload, self.profile, spec.cap)
            if cap > 0 and not spec.drafter.prediction.size:
                eligible = True  # this step is one the gate's mode decides
                if not mode:  # the gate measured drafting from the context slower at this concurrency
                    ks.append(0)
                    continue
            k = choose_depth(cap, spec.acceptance, running, self.profile.draft_token_cost)
            lookup = k > 0 and not spec.drafter.prediction.size
            if lookup and spec.wait:  # a failed search's wait: this step decodes without searching
                spec.wait -= 1
                k = 0
            ks.append(k)
            # drafts past the token limit could never be emitted; the step's token budget bounds its time
            k = min(k, seq.max_tokens - seq.num_output - 1, budget)
            draft = spec.drafter.propose(seq.token_ids, k) if k > 0 else []
            if lookup and k > 0:
                spec.misses = 0 if draft else spec.misses + 1
                spec.wait = miss_wait(spec.misses, MISS_WAIT_MAX)
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
        # timed: steps where some sequence could draft from its context (a step of requests with
        # max_draft_tokens 0 says nothing about drafting), except an off-mode step that verifies a
        # prediction's drafts, which is neither mode's cost
        timed = self.gate is not None and eligible and (mode or not drafts)
        self._timed = (running, mode, sampled) if timed else None
        return drafts

    def skip_drafts(self, engine, seqs: list[Sequence]) -> bool:
        """Whether the next step of `seqs` (each decoding its next token) drafts nothing whatever their latest
        tokens are, so it may be launched before those are read (engine.py, overlap): no sequence has a
        prediction, and no rule drafts at this concurrency, or the gate has drafting from the context off here,
        or it has it on and every sequence's acceptance says depth 0 for this step (no probe due) or waits after
        a search that found nothing (MISS_WAIT_MAX): sampled text while the gate explores drafting, and novel text
        where lookups fail, which before ran those steps one at a time for nothing.
        When it does, the step is counted and timed as propose() would count and time it, by skipped(), which the
        engine calls once it launches the step (a launch that backs out after this leaves the step to propose())."""
        self._forget_ended(engine)  # steps launched ahead may follow each other without a propose() between
        running = len(engine.scheduler.running)
        timed, eligible = None, []
        if self.may_draft(running):
            sampled = 2 * sum(not seq.sampling.greedy for seq in seqs) > len(seqs)
            mode = self.gate.drafting(running, sampled) if self.gate is not None else True
            cost = self.profile.draft_token_cost
            for seq in seqs:
                spec = self._seqs.get(seq.request_id)
                if spec is None:
                    continue
                if spec.drafter.prediction.size:
                    return False  # a prediction drafts in either mode
                cap = choose_k(len(seq.token_ids) + 1, running, spec.workload, self.profile, spec.cap)
                if cap > 0:
                    depth = next_depth(cap, spec.acceptance, running, cost) if mode else 0
                    if depth > 0 and not spec.wait:
                        return False  # propose() drafts for it once its latest token is read
                    eligible.append((spec, depth))
            timed = (running, mode, sampled) if eligible and self.gate is not None else None
            if not mode:
                eligible = []  # counted only in drafting mode, as propose() counts them
        self._skip = (eligible, timed, len(seqs))
        return True

    def skipped(self) -> None:
        """The step skip_drafts() last said yes to was launched: count and time it as propose() would."""
        eligible, self._timed, n = self._skip
        for spec, depth in eligible:
            if depth > 0:
                spec.wait -= 1  # one of its waiting steps, as propose() counts it
            spec.acceptance.counted(depth)  # as choose_depth counts the step: depth 0 toward the next probe
        self.steps_by_k[0] += n
        self.last_k = 0

    def _forget_ended(self, engine) -> None:
        for rid in [r for r in self._seqs if r not in engine.seqs]:  # finished or aborted since
            spec = self._seqs.pop(rid)
            self.prior.ended(spec.kind, spec.acceptance)

    def may_draft(self, running: int) -> bool:
        """Whether any rule of the profile's table gives K > 0 at this concurrency (choose_k's first match
        can then be positive for some context and workload); when none does, `propose` skips its per-sequence
        work, which at 256 sequences cost ~0.5 ms a step on the dev box for drafts that were all 0."""
        may = self._may_draft.get(running)
        if may is None:
            may = self._may_draft[running] = self.profile.max_draft_tokens > 0 and any(
                rule.k > 0 and running <= rule.max_concurrency for rule in self.profile.speculation)
        return may

    def observe(self, tokens: int, prefilled: int, seconds: float) -> None:
        """The step `propose` began took `seconds` and emitted `tokens`; decode-only steps feed the gate."""
        timed, self._timed = self._timed, None
        if timed is not None and not prefilled:
            self.gate.observe(timed[0], timed[1], tokens, seconds, timed[2])

    # --- verification ------------------------------------------------------------------------------
    def verify(self, engine, scheduled: list[tuple[Sequence, int]], drafts: dict[int, list[int]]):
        """Run the step with every draft in it; returns (outputs, prefilled token count)."""
        runs = [(seq, n + len(drafts.get(b, []))) for b, (seq, n) in enumerate(scheduled)]
        batch = build_batch(runs, engine.blocks.block_size, engine.model.xp, drafts, engine.blocks.tables)
        # every logits row is sampled: a drafting sequence's rows are its next tokens' draws in order
        ahead, prev = [], None
        for b in batch.sample_rows:
            ahead.append(ahead[-1] + 1 if b == prev else 0)
            prev = b
        step_rows = engine.sample_rows([scheduled[b][0] for b in batch.sample_rows], ahead)
        engine.sampler.stage(step_rows)
        logits = engine.model.forward(batch, engine.kv)
        plain_rows, plain_seqs, plain_samples, draft_rows, draft_samples, draft_groups = [], [], [], [], [], []
        for b, (seq, n) in enumerate(scheduled):
            if b not in drafts:
                seq.num_computed += n  # as in a plain step: the whole chunk is now in the cache
                engine.blocks.commit_full_blocks(seq)
        for row, (b, a) in enumerate(zip(batch.sample_rows, ahead)):
            seq = scheduled[b][0]
            if b not in drafts:
                plain_rows.append(row)
                plain_seqs.append(seq)
                plain_samples.append(step_rows[row])
            else:
                draft_rows.append(row)
                draft_samples.append(step_rows[row])
                if a == 0:
                    draft_groups.append((seq, drafts[b]))
        outputs = []
        if plain_rows:  # sequences without a draft sample exactly as in a plain step
            outputs += engine._sample(logits, plain_seqs, index=plain_rows, rows=plain_samples)
        if draft_groups:
            outputs += self._accept(engine, logits, draft_rows, draft_groups, draft_samples)
        return outputs, batch.num_tokens - len(batch.sample_rows)

    def _accept(self, engine, step_logits, rows: list[int], groups: list[tuple[Sequence, list[int]]], sample_rows):
        """Each group's drafts against the sampler's own draws at its rows (`rows` of `step_logits`, each
        group's consecutive; `sample_rows`: the step's sample rows there, the ones staged before its forward):
        a draft is kept while it equals the token the sampler draws at its position
        (the argmax when greedy), and the first draw that differs is emitted in its place. With the draws
        keyed by (seed, token index), that is the token plain decoding would have drawn there: exact for
        any temperature, and the same tokens as without speculation (sampler.py)."""
        ids = [seq.request_id for seq, d in groups for _ in range(len(d) + 1)]
        targets, lps = engine.choose(step_logits, sample_rows, ids, index=rows,
                                     drafts={s.request_id: d for s, d in groups})
        outputs, row = [], 0
        for seq, draft in groups:
            width = len(draft) + 1
            emitted, kept = _accept_greedy(draft, targets[row : row + width].tolist())
            self._count(seq, draft, kept)
            emitted = _cut_at_stop(seq, emitted)
            seq.num_accepted += min(kept, len(emitted))  # drafts past a stop are kept but not emitted
            entries = None
            if seq.logprobs is not None:  # emitted token i is the draw at row i: its entry is that row's
                entries = [lp for entry in lps[row : row + len(emitted)] for lp in entry]
            outputs.append(self._emit(engine, seq, emitted, entries))
            row += width
        return outputs

    def _count(self, seq: Sequence, draft: list[int], kept: int) -> None:
        for i in range(min(len(draft), len(self.drafted_by_position))):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < kept
        seq.num_drafted += len(draft)
        spec = self._seqs.get(seq.request_id)
        if spec is not None:
            spec.acceptance.update(len(draft), kept)

    def _emit(self, engine, seq: Sequence, emitted: list[int], lps):
        """Roll `seq` forward by the emitted tokens: all but the last already have K/V from this step."""
        seq.token_ids.extend(emitted[:-1])
        seq.num_computed = len(seq.token_ids)  # the last known token's K/V is the next step's to compute
        engine.blocks.commit_full_blocks(seq)
        engine.blocks.truncate(seq, seq.num_computed + 1)
        if engine.constraints is not None:
            engine.constraints.advance([seq.request_id] * len(emitted), emitted)
        # finishes it on a stop token or at its limit
        return engine.append_tokens([seq], [emitted[-1]], [emitted], [lps])[0]


def _accept_greedy(draft: list[int], targets: list[int]) -> tuple[list[int], int]:
    """(emitted tokens, drafts kept): drafts while they match the model's argmax, then its own token."""
    kept = 0
    while kept < len(draft) and draft[kept] == targets[kept]:
        kept += 1
    return draft[:kept] + [targets[kept]], kept


def _cut_at_stop(seq: Sequence, emitted: list[int]) -> list[int]:
    """The emitted tokens up to and including the first stop token or the one that reaches max_tokens."""
    for j, token in enumerate(emitted):
        if token in seq.stop_token_ids or seq.num_output + j + 1 >= seq.max_tokens:
            return emitted[: j + 1]
    return emitted
