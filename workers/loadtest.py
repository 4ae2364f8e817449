"""The load-test backend: an instrument for measuring gateway overhead, not a model.

It streams a configured number of tokens at a configured rate and does no inference, so what a
benchmark measures in front of it is the gateway and the channel. Selected with
`pulse serve --backend loadtest`; never a default. With `batch` it behaves toward admission as an engine does past
saturation: `batch` streams generate at once, the others wait inside it in arrival order (an engine's scheduler
queue, which takes whatever the gateways send), and its stats say `batch` slots and `worker_queue` places.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from workers.protocol import Backend, BackendError, BackendStats, Chunk, GenerateRequest, Usage


class LoadTestBackend(Backend):
    name = "loadtest"

    def __init__(self, config, profile=None, model=None, block_sink=None, worker_id: str = "w0"):
        self.cfg = config.workers.loadtest
        self.worker_id = worker_id
        self.running = 0
        self.generated = 0
        self._started = time.monotonic()
        self._cancelled: set[str] = set()
        self._batch = asyncio.Semaphore(self.cfg.batch) if self.cfg.batch else None  # FIFO: asyncio's waiters queue
        self.waiting = 0

    async def start(self) -> None:
        self._started = time.monotonic()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        if self.running + self.waiting >= self.cfg.slots:
            raise BackendError("load-test backend is at its slot limit", 429, "no_capacity")
        if self._batch is not None:
            self.waiting += 1
            try:
                await self._batch.acquire()
            finally:
                self.waiting -= 1
        self.running += 1
        try:
            n = min(self.cfg.tokens, request.max_tokens)
            gap = 1.0 / self.cfg.tokens_per_s if self.cfg.tokens_per_s > 0 else 0.0
            first = len(request.resume_ids)  # a migrated request continues where it was
            for i in range(first, n):
                if request.request_id in self._cancelled:
                    break
                # the first token after ttft_s (default at once) and later ones at the rate, as bench/relay.py's
                # upstream paces its stream: bench/gateway_overhead.py's held streams then differ only by the gateway
                # (a first token held back one gap had added 1/rate to every "added TTFT" there)
                if i == first and self.cfg.ttft_s:
                    await asyncio.sleep(self.cfg.ttft_s)
                elif i > first:
                    await asyncio.sleep(gap)  # 0 (no rate): still yield, like a real backend between steps
                self.generated += 1
                yield Chunk(text=f" t{i}", token_ids=[1000 + i])
            usage = Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=n)
            yield Chunk(finish_reason="length" if n == request.max_tokens else "stop", usage=usage)
        finally:
            self.running -= 1
            self._cancelled.discard(request.request_id)
            if self._batch is not None:
                self._batch.release()

    async def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    async def health(self) -> bool:
        return True

    def stats(self) -> BackendStats:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        batch = self.cfg.batch  # with one, the places an engine says it has; without, every accepted stream runs
        return BackendStats(running=self.running, waiting=self.waiting, slots=batch or self.cfg.slots,
                            queue_max=self.cfg.worker_queue if batch else None,
                            tokens_per_s=self.generated / elapsed, generated_tokens=self.generated)

    async def close(self) -> None:
        return None
