"""One generation's chunks across workers: a worker that fails mid-stream hands the request on.

    relay = Relay(dispatcher, gen, ticket, metrics)
    async for batch in relay.batches(): ...   # ends with a final chunk (finish_reason "error" only when
                                              # the generation could not go on anywhere)
    relay.close()                             # always, in finally

Before the first chunk the dispatcher retries elsewhere (gateway/dispatch.py). After it, a broken worker
stream (connection reset, EOF without a final chunk, an unreadable line, or an in-band error chunk such
as a draining worker's engine closing or a worker's llama-server process dying) becomes a continuation:
the same GenerateRequest with `resume_ids` = the tokens already relayed to the client, opened on a worker
not tried yet. The worker continues as if it had produced those tokens itself (sampler index, stop
strings, grammar, max_tokens and usage count them; workers/protocol), so the client sees one stream, and
a greedy or seeded one on the engine is the same text an undisturbed run gives (llama-server: greedy
only, and only as far as llama.cpp's output does not depend on the batch it ran in). At most
`max_migrations` hand-overs per request. When no untried worker of the model is routable at that moment but
one is known (unhealthy on its last poll, its circuit open, its llama-server restarting), the hand-over waits
for it up to `wait_s` (server.migration_wait_s): the client cannot retry a stream it has half received. When
every worker of the model has been tried (one worker: the single-box default), a worker tried before may take
the stream back once, after the same wait for it to be routable: a killed worker actor that Ray restarts, or a
worker whose engine process or llama-server it restarts, comes back in seconds, and the stream goes on there.
Once only: a request that brought a worker down twice is not sent to it a third time (a query of death costs
the others' streams one hand-over, not an endless loop). When none is possible the last batch is one error
chunk, which the protocol writes as one in-band error event.

The response's `x-pulse-worker` header names the worker the request was routed to (`first_worker`): a
stream's headers have left before any hand-over, so a non-streamed answer names the same one. Each
hand-over is an event on the request's span (EVENT_MIGRATED: the failed worker, the one continuing, the
tokens it resumed from), a log line and a `pulse_stream_migrations_total` count.
"""
from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import AsyncIterator

import aiohttp
import msgspec

from gateway.dispatch import Dispatcher, Ticket
from gateway.errors import APIError
from gateway.pool import WorkerState
from workers.protocol import Chunk, GenerateRequest, Usage
from workers.protocol import telemetry as tm

log = logging.getLogger("pulse.gateway.migration")

# what a dead or unreachable worker's stream raises while it is read (ValueError: a torn JSON line)
BROKEN = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)
EVENT_MIGRATED = "pulse.migrated"  # an event on the request's span, one per hand-over
WAIT_POLL_S = 0.1  # how often a hand-over waiting for a worker looks at the pool (its polls update it)


class Relay:
    def __init__(self, dispatcher: Dispatcher, gen: GenerateRequest, ticket: Ticket, metrics, *,
                 max_migrations: int = 2, wait_s: float = 15.0):
        self.dispatcher, self.gen, self.metrics = dispatcher, gen, metrics
        self.wait_s = wait_s
        self.ticket: Ticket | None = ticket
        self.first_worker: WorkerState = ticket.worker  # the one the response headers name
        self.max_migrations = max_migrations
        self.migrations = 0
        # token ids of every chunk handed to the caller so far, 4 bytes each (a list would also keep each id's
        # int object alive: ~36 bytes a token, 1.2 MB for a 32k-token stream)
        self.delivered = array("i")
        self._tried = {ticket.worker.worker_id}
        self._retried: set[str] = set()  # tried workers given the stream back once (_exclusion)

    def close(self) -> None:
        if self.ticket is not None:
            self.dispatcher.close(self.ticket)
            self.ticket = None

    async def batches(self) -> AsyncIterator[list[Chunk]]:
        batch, chunks = self.ticket.first, self.ticket.chunks
        while True:
            good, broken = _until_end(batch)
            if good:
                yield good
                for c in good:
                    self.delivered.fromlist(c.token_ids)
                if good[-1].finish_reason is not None:
                    return
            if broken is None:
                try:
                    batch = await chunks.__anext__()
                    continue
                except StopAsyncIteration:
                    broken = "the worker stream ended without a result"
                except BROKEN as e:
                    broken = f"{type(e).__name__}: {e}"
                    self.dispatcher.pool.record_failure(self.ticket.worker)
            failed = self.ticket.worker.worker_id
            resumed = await self._hand_over(broken)
            if isinstance(resumed, Chunk):
                yield [resumed]
                return
            batch, chunks = resumed
            log.info("stream %s moved from %s to %s after %d tokens (%s)", self.gen.request_id, failed,
                     self.ticket.worker.worker_id, len(self.delivered), broken)

    async def _hand_over(self, broken: str):
        """Open the continuation elsewhere: (its first batch, its batch iterator), or the final Chunk to end
        the stream with when it cannot go on."""
        failed = self.ticket.worker.worker_id
        await _quietly_close(self.ticket.chunks)
        self.close()
        if len(self.delivered) >= self.gen.max_tokens:  # every token arrived, only the final chunk was lost
            return Chunk(finish_reason="length", usage=Usage(prompt_tokens=len(self.gen.prompt_ids),
                                                             completion_tokens=len(self.delivered)))
        why = f"worker {failed} failed mid-stream"
        if self.migrations >= self.max_migrations:
            return self._failed(f"{why} after {self.migrations} hand-overs", broken)
        self.migrations += 1
        follow_on = msgspec.structs.replace(self.gen, request_id=f"{self.gen.request_id}.m{self.migrations}",
                                            resume_ids=self.delivered.tolist())
        try:
            self.ticket = await self._open_elsewhere(follow_on)
        except APIError as e:
            return self._failed(f"{why} and no other worker could continue it", f"{broken}; {e.message}")
        taken = self.ticket.worker.worker_id
        (self._retried if taken in self._tried else self._tried).add(taken)
        self.metrics.migrated("resumed")
        tm.trace.get_current_span().add_event(EVENT_MIGRATED, {
            "pulse.worker.failed": failed, tm.PULSE_WORKER: self.ticket.worker.worker_id,
            "pulse.resumed_tokens": len(self.delivered)})
        return self.ticket.first, self.ticket.chunks

    async def _open_elsewhere(self, follow_on: GenerateRequest) -> Ticket:
        """The continuation on a worker _exclusion allows. While none is routable but one is known, wait for it
        (its next poll may find it healthy again, a restarted worker at its new address) up to `wait_s`, trying
        again each time one is routable; then the last refusal stands."""
        deadline = time.monotonic() + self.wait_s
        while True:
            exclude = self._exclusion(follow_on)
            await self._until_routable(follow_on, exclude, deadline)
            try:
                return await self.dispatcher.open(follow_on, exclude=exclude)
            except APIError as e:
                if e.status != 503 or not self.dispatcher.untried(follow_on, exclude) \
                        or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(WAIT_POLL_S)

    def _exclusion(self, gen: GenerateRequest) -> set[str]:
        """The workers the continuation may not go to: every one tried, while a worker of the model not tried
        yet is known; once none is, only those that already took the stream back once."""
        return self._tried if self.dispatcher.untried(gen, self._tried) else self._retried

    async def _until_routable(self, gen: GenerateRequest, exclude: set[str], deadline: float) -> None:
        """Return once a worker not in `exclude` is routable, none is known, or `deadline` has passed."""
        while True:
            now = time.monotonic()
            known = self.dispatcher.untried(gen, exclude)
            if not known or now >= deadline or any(w.routable(now) for w in known):
                return
            await asyncio.sleep(WAIT_POLL_S)

    def _failed(self, message: str, detail: str) -> Chunk:
        """The error chunk that ends the stream; `detail` (exception text, addresses) goes to the log only."""
        log.warning("stream %s lost: %s (%s)", self.gen.request_id, message, detail)
        self.metrics.migrated("failed")
        return Chunk(finish_reason="error", error=message)


def _until_end(batch: list[Chunk]) -> tuple[list[Chunk], str | None]:
    """The chunks of `batch` up to its final one (included), and the error of an in-band error chunk
    (which is left out: the generation goes on elsewhere)."""
    if batch[-1].finish_reason is None:  # most batches: a worker sends nothing after its final chunk
        return batch, None
    return _scan_to_end(batch)


def _scan_to_end(batch: list[Chunk]) -> tuple[list[Chunk], str | None]:
    """_until_end, chunk by chunk."""
    for i, c in enumerate(batch):
        if c.finish_reason == "error":
            return batch[:i], c.error or "generation failed"
        if c.finish_reason is not None:
            return batch[: i + 1], None
    return batch, None


async def _quietly_close(chunks) -> None:
    try:
        await chunks.aclose()
    except Exception:  # the stream is broken already; closing it is only tidying
        pass
