"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (chunked prefill). Running sequences go first, oldest first: a decoding
sequence costs one token, a sequence still in prefill takes the next chunk the budget allows. Then
waiting sequences join, attaching their cached prefix blocks, while there are free slots, budget and KV
blocks. When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are released (full ones stay in the prefix cache) and it goes back to the front
of the queue to be recomputed later, tokens generated so far included, so nothing is lost.

Prefill coalescing (`prefill_wait_steps` W > 0, from the device profile; off in every built-in profile): on a
GPU a step of pure decodes replays a CUDA graph, while a step that carries any prompt tokens runs eagerly (one
Python launch per kernel). When requests arrive one by one, admitting each at once makes many steps eager
(the engine alone with staggered arrivals: 37% of the steps at 64 sequences, 75% at 256, and W 8 raised its
tok/s 1.1-1.3x; served through `pulse serve` it showed no gain: BENCHMARKS.md, issue 25). With W > 0 a waiting
request joins a step that is all decodes only once the oldest waiting one has waited W steps; it joins at once
when nothing is running (an idle engine never waits), when the step already carries prompt tokens (a running
sequence's prefill chunk: the step is eager anyway), and a preempted sequence (back at the front of the queue)
is not held. The cost is up to W decode steps of time to
first token for a request that arrives while others decode.

Steps that fit a graph (`schedule(graph_tokens)`, the GPU model's mixed_step_tokens: its largest verify graph,
512 tokens at a 256-sequence batch): a step carrying short prompt chunks beside decodes replays a verify graph
when its tokens fit one (workers/cupy/gpu/verify.py). Closed-loop clients finish together and their next
requests arrive together, so at a full batch one step could admit a dozen prompts at once, pass the largest
graph and run eagerly (~5% of the steps past saturation on the H200, ~10% of the engine thread; BENCHMARKS.md,
issue 25). With `workers.engine.fit_graphs`, while anything is running, waiting requests join only up to the
graph's tokens; the rest join the next step, a step later. A running sequence's own prefill chunks are not capped
(a long prompt still makes its steps eager), nor is a step that nothing runs in (the first burst prefills at the
full budget). Off by default: served on the H200 it took the eager steps from 2-7% to 0 and served no faster, inside
a +-15% spread (BENCHMARKS.md, issue 25, 2026-12-04 05:31 UTC).
"""
from __future__ import annotations

import itertools
from collections import deque

from workers.cupy.kv_cache import BlockManager
from workers.cupy.sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_step_tokens: int, prefill_wait_steps: int = 0):
        self.blocks = blocks
        self.prefill_wait_steps = prefill_wait_steps
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max(max_step_tokens, max_num_seqs)  # room for every decode token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._preempted_now = 0  # preemptions in the step being scheduled: then nobody new is admitted
        self._arrivals = itertools.count()
        self.steps = 0  # schedule() calls: the clock prefill coalescing counts in
        self.held_steps = 0  # steps in which a waiting request was held back to coalesce prefills
        self._unordered = False  # `running` may be out of arrival order (schedule() sorts it then)

    def add(self, seq: Sequence) -> None:
        seq.status, seq.arrival = SeqStatus.WAITING, next(self._arrivals)
        seq.queued_step = self.steps
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, graph_tokens: int = 0) -> list[tuple[Sequence, int]]:
        """This step's (sequence, number of new tokens); blocks for them are allocated.

        `graph_tokens` (> 0: the model's mixed_step_tokens): while sequences are running, waiting requests join
        only up to that many tokens in the step, so that a step of decodes and new prompts replays a graph instead
        of running eagerly; the rest join the next step (module docstring)."""
        budget, scheduled = self.max_step_tokens, []
        self._preempted_now = 0
        self.steps += 1
        # oldest first, so every preemption victim (the newest) is one not yet scheduled in this step; admission
        # appends in arrival order, so only a preempted sequence's return can put the list out of order
        if self._unordered:
            self.running.sort(key=lambda s: s.arrival)
            self._unordered = False
        bs, running = self.blocks.block_size, SeqStatus.RUNNING
        for seq in list(self.running):
            if seq.status is not running or budget == 0:
                continue  # preempted earlier in this loop, or out of budget until next step
            n = len(seq.token_ids) - seq.num_computed  # num_remaining, inline (once per sequence per step)
            if n > budget:
                n = budget
            # most decode steps stay inside the last block (one step in 16 starts a new one): no block calls then
            if seq.num_computed + n > len(seq.block_table) * bs:
                if not self._make_room(seq, n):
                    continue
                self.blocks.allocate(seq, n)
            scheduled.append((seq, n))
            budget -= n
        if self._preempted_now == 0 and self.waiting:  # admitting now would only take from the preempted
            if self._admit_now(scheduled):
                used = self.max_step_tokens - budget
                if graph_tokens and scheduled and used < graph_tokens:  # past it the step is eager anyway
                    budget = min(budget, graph_tokens - used)
                self._admit(budget, scheduled)
            else:
                self.held_steps += 1
        return scheduled

    def _admit_now(self, scheduled: list) -> bool:
        """Whether waiting requests join this step (prefill coalescing, the module's docstring)."""
        if self.prefill_wait_steps <= 0 or not scheduled:
            return True
        if self.steps - self.waiting[0].queued_step >= self.prefill_wait_steps:
            return True
        return any(n > 1 or seq.num_computed + n < len(seq.token_ids) for seq, n in scheduled)

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Preempt newer sequences until `seq` can have blocks for `n` tokens; False if `seq` itself went."""
        while not self.blocks.can_allocate(seq, n):
            victim = max(self.running, key=lambda s: s.arrival)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, scheduled: list) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq)
            n = min(seq.num_remaining, budget)
            if not self.blocks.can_allocate(seq, n):
                self.blocks.free(seq)  # give the prefix blocks back; they stay cached
                break
            self.waiting.popleft()
            if seq.num_cached < 0:
                seq.num_cached = cached
            self.blocks.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            if self.running and seq.arrival < self.running[-1].arrival:
                self._unordered = True  # a preempted sequence back (it keeps its first arrival)
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        seq.queued_step = -self.prefill_wait_steps  # back at the front: never held for coalescing
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self._preempted_now += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out (finished, cancelled or failed) and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
