"""Cross-step pipelining: the engine keeps several steps in the ring at once, one per group of sequences.

The plain engine's step is schedule -> forward -> sample, and a pipelined forward drains every stage at
the step's end: while the driver samples, and while stage 0 starts the next step, the other stages idle.
Here the running sequences are dealt into `groups` groups (about equal, oldest first). A group's step is
launched into the ring and the engine moves on: it launches the next group's step, then takes the oldest
group's result back, samples it, and launches that group's next step at once, so stage 0 already runs
group A's step t+1 while the last stage still runs group B's step t and the driver samples.

A sequence is in at most one launched step (its next token depends on the last), so a group's steps stay
in order and greedy output is the plain engine's. What this costs: every launch is its own message round
and head, and a step's token budget applies per group. Speculation verifies in one synchronous forward
(workers/cupy/speculative.py), so with a speculator the engine finishes what is in flight and steps
plainly. Off by default (`workers.engine.pipeline_overlap`): docs/PIPELINE.md has the measurement.
"""
from __future__ import annotations

import math
from collections import deque

from workers.cupy.batch import build_batch
from workers.cupy.engine import Engine, StepOutput
from workers.cupy.sequence import Sequence, SeqStatus
from workers.pipeline.runner import StageLost


class OverlapEngine(Engine):
    """An Engine over a PipelinedModel; `groups` >= 2 turns cross-step pipelining on (0 or 1: plain)."""

    groups: int = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._flight: deque[tuple[object, list[tuple[Sequence, int]]]] = deque()  # launched: (batch, scheduled)
        self._busy: set[Sequence] = set()

    def has_work(self) -> bool:
        return bool(self._flight) or super().has_work()

    def step(self) -> list[StepOutput]:
        plain = self.groups < 2 or self.speculator is not None
        if plain and not self._flight:
            return super().step()
        try:
            if not plain:
                self._fill()
            if not self._flight:
                self.blocks.flush_events()
                return []
            outputs, prefilled = self._finish_oldest()
        except Exception as exc:
            self._abandon(exc)
            raise
        self.blocks.flush_events()
        self._record(outputs, prefilled)
        return outputs

    def _fill(self) -> None:
        """Launch group steps until `groups` are in the ring or nothing else is ready."""
        while len(self._flight) < self.groups:
            scheduled = self._schedule_group()
            if not scheduled:
                return
            batch = build_batch(scheduled, self.blocks.block_size, self.model.xp, tables=self.blocks.tables)
            self.model.launch(batch, self.kv, parts=1)  # the group is the micro-batch
            self._flight.append((batch, scheduled))
            self._busy.update(seq for seq, _ in scheduled)

    def _schedule_group(self) -> list[tuple[Sequence, int]]:
        """The scheduler's choice over the sequences not in flight, at most a group's share of them: the
        in-flight ones are hidden from it (they hold their blocks and cannot be preempted mid-step)."""
        sch = self.scheduler
        active = min(len(sch.running) + len(sch.waiting), sch.max_num_seqs)
        share = math.ceil(active / self.groups)
        ready = sorted((s for s in sch.running if s not in self._busy), key=lambda s: s.arrival)
        visible, hidden = ready[:share], [s for s in sch.running if s in self._busy] + ready[share:]
        limit, free = sch.max_num_seqs, sch.max_num_seqs - len(sch.running)
        sch.running, sch.max_num_seqs = visible, min(share, len(visible) + free)
        try:
            return sch.schedule()
        finally:
            sch.running, sch.max_num_seqs = sch.running + hidden, limit

    def _finish_oldest(self) -> tuple[list[StepOutput], int]:
        batch, scheduled = self._flight[0]
        logits = self.model.collect()
        self._flight.popleft()
        self._busy.difference_update(seq for seq, _ in scheduled)
        for seq, n in scheduled:
            if seq.status is not SeqStatus.FINISHED:  # not aborted while its step was in the ring
                seq.num_computed += n
                self.blocks.commit_full_blocks(seq)
        rows = [i for i, b in enumerate(batch.sample_rows) if scheduled[b][0].status is not SeqStatus.FINISHED]
        if len(rows) < len(batch.sample_rows):
            logits = logits[self.sampler.xp.asarray(rows)]
        outputs = self._sample(logits, [scheduled[batch.sample_rows[i]][0] for i in rows]) if rows else []
        return outputs, batch.num_tokens - len(batch.sample_rows)

    def _abandon(self, exc: Exception) -> None:
        """After a failure nothing in flight will be sampled: keep the ring in step (a lost stage's ring is
        rebuilt instead) and forget the launches; the backend then fails or requeues their sequences."""
        if not isinstance(exc, StageLost):
            try:
                self.model.drain()
            except Exception:
                pass
        self._flight.clear()
        self._busy.clear()
