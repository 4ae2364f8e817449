"""Bringing a pipelined engine back after a stage died.

A stage's death shows in the driver as a closed socket (StageLost, from runner.py) in the middle of a step.
What was in its layers' KV is gone, so every cached block is gone with it: the blocks are content-addressed
across all layers, and half a block is no block. Recovery, in the engine's thread between steps:

1. Requests that have streamed output end with a clear error (503, in band: the client has tokens already).
   Requests without output go back to the queue and run again once the stage is back: the gateway's rule
   is to retry only before the first byte, and this is that retry, kept on this worker (each request gets
   it once; a request caught by a second loss fails with a 503 the gateway can retry elsewhere).
2. The ring is rebuilt: Ray restarts a dead stage actor itself (a dead local process is started again),
   the survivors keep their weights, every stage is wired again and allocates its KV anew, empty.
3. The prefix cache is dropped: a fresh block manager, and one "evicted" event for every block the router
   was told about, so it stops sending prefix traffic here for blocks that no longer exist.
"""
from __future__ import annotations

import logging
import time

from workers.cupy.kv_cache import BlockManager
from workers.cupy.sequence import SeqStatus
from workers.pipeline.runner import StageLost
from workers.protocol import BackendError, BlockEvent, BlockSink

log = logging.getLogger(__name__)


class LiveBlocks:
    """The block sink the pipelined engine's block manager writes to: passes every event on and keeps the
    set of block hashes the router currently believes this worker holds."""

    def __init__(self, sink: BlockSink | None):
        self.sink, self.live = sink, set()

    def __call__(self, event: BlockEvent) -> None:
        if event.kind == "added":
            self.live.update(event.hashes)
        else:
            self.live.difference_update(event.hashes)
        if self.sink is not None:
            self.sink(event)

    def evict_all(self) -> int:
        hashes, self.live = sorted(self.live), set()
        if hashes and self.sink is not None:
            self.sink(BlockEvent(kind="evicted", hashes=hashes))
        return len(hashes)


class StageRecovery:
    """Held by a pipelined engine (`engine.pipeline_recovery`); the backend calls `run` on StageLost."""

    def __init__(self, engine, stages, blocks: LiveBlocks):
        self.engine, self.stages, self.blocks = engine, stages, blocks
        self.recoveries = 0
        self._retried: set[str] = set()  # requests already put back once

    @staticmethod
    def handles(exc: Exception) -> bool:
        return isinstance(exc, StageLost)

    def run(self, exc: Exception) -> dict[str, BackendError]:
        """Recover from `exc` (a StageLost); returns the error for each request that had to fail."""
        t0 = time.perf_counter()
        failed = self._settle_requests(exc)
        restarted = self.engine.model.rebuild(self.stages)
        self._drop_prefix_cache()
        self.recoveries += 1
        log.warning("pipeline rebuilt in %.1f s (stages restarted: %s); %d requests failed, %d requeued",
                    time.perf_counter() - t0, restarted, len(failed), len(self.engine.seqs))
        return failed

    def _settle_requests(self, exc: Exception) -> dict[str, BackendError]:
        eng, failed = self.engine, {}
        self._retried &= set(eng.seqs)  # forget finished requests
        for rid, seq in list(eng.seqs.items()):
            if seq.num_output > 0 or rid in self._retried:
                eng.abort(rid, "error")
                failed[rid] = BackendError(f"a pipeline stage was lost mid-request ({exc}); the stage is being "
                                           "rebuilt: retry the request", 503, "stage_lost")
            else:
                self._retried.add(rid)
                if seq.status is SeqStatus.RUNNING:  # back to the queue's front, to be computed again
                    eng.scheduler.preempt(seq)
        return failed

    def _drop_prefix_cache(self) -> None:
        eng = self.engine
        old = eng.blocks
        old.flush_events()
        n = self.blocks.evict_all()
        # every sequence left is waiting and holds no block, so a fresh manager loses nothing but the cache
        eng.blocks = eng.scheduler.blocks = BlockManager(old.num_blocks, old.block_size, self.blocks,
                                                         old.local.num_blocks if old.local else None, old.window,
                                                         old.root)
        log.info("pipeline: prefix cache dropped (%d blocks reported evicted)", n)
