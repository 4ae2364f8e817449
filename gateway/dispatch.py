"""From an accepted request to an open worker stream: admission, routing, retry before the first byte.

    dispatcher = Dispatcher(pool, router, gate, metrics, tracer, context_length=..., index=...)
    ticket = await dispatcher.open(gen)        # raises APIError (429 / 503 / 4xx) when it cannot
    ... relay ticket.first, then iter ticket.chunks (gateway/migration.py's Relay does, and moves a
        stream whose worker fails mid-way to another one) ...
    dispatcher.close(ticket)                   # always, in finally

Only the workers holding the request's model (GenerateRequest.model) are candidates.
Routing asks the prefix index once (gateway/router.py) and the pure policy decides; admission (the
gateway's queue, policy/admission) decides whether the chosen worker can take it now, later, or never.
A worker that fails before its first chunk is marked and the request goes to another one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.pool import WorkerPool, WorkerState, iter_batches
from policy.types import AdmissionRequest
from workers.protocol import BackendError, Chunk, GenerateRequest
from workers.protocol import telemetry as tm

log = logging.getLogger("pulse.gateway.dispatch")


@dataclass
class Ticket:
    worker: WorkerState
    response: object  # the aiohttp response of the worker stream
    chunks: object  # async iterator of the remaining Chunks, in batches (what one read brought in)
    first: list[Chunk]
    reason: str
    cached_tokens: int


class Dispatcher:
    def __init__(self, pool: WorkerPool, router, gate, metrics, tracer, *, context_length: int,
                 index=None, max_retries: int = 2):
        self.pool, self.router, self.gate = pool, router, gate
        self.metrics, self.tracer = metrics, tracer
        self.context_length = context_length
        self.index = index  # in-process index: the gateway records where it sent each prompt at once
        self.max_retries = max_retries

    async def open(self, gen: GenerateRequest, exclude: set[str] = frozenset()) -> Ticket:
        """`exclude`: worker ids not to send it to (a migrated request's failed workers: gateway/migration.py)."""
        tried: set[str] = set(exclude)
        last: BackendError | None = None
        since = self.gate.now()  # a request back from a refusal waits only what is left of its queue deadline
        failures = 0
        while failures <= self.max_retries:
            routed = await self._admit(gen, tried, since)
            w = routed.worker
            tried.add(w.worker_id)
            # Before any await, so the next routing decision sees this request: its slot, the prefill it
            # queues there, and (in-process index) the blocks the worker is about to compute.
            prefill = max(0, len(gen.prompt_ids) - routed.cached_tokens)
            w.opened()
            w.pending_prefill += prefill
            self._remember(w, routed)
            try:
                resp = await self.pool.open_stream(w, gen)
                chunks = iter_batches(resp)
                first = await self._first(w, resp, chunks)
            except BackendError as e:
                w.closed()
                w.pending_prefill -= prefill
                self._forget(w, routed)
                self.gate.leave()
                last = e
                # 429: that worker is full; 421: it does not hold the model (the gateway's view of it was
                # stale, e.g. a worker restarted with another model): both try another worker
                if e.status < 500 and e.status not in (421, 429):
                    raise APIError(e.status, e.message, code=e.code) from None
                if e.status == 429 and w.worker_id not in exclude:
                    # full, not gone: counted full until its next poll, so this request waits in the queue for
                    # a place there (or another worker's) instead of running out of workers (that was a 503
                    # "no healthy worker" from the only worker, under load from two replicas). Not a failure
                    # either: the gateway's view was stale, and another replica can win the race for the place
                    # a poll showed free more than max_retries times in a row (two replicas, one flooding: a
                    # client got the worker's 429 after three refusals, CI); the queue deadline (AdmissionGate.enter's
                    # `since`) bounds it.
                    w.refused = True
                    tried.discard(w.worker_id)
                    continue
                failures += 1
                continue
            except BaseException:
                w.closed()
                w.pending_prefill -= prefill
                self.gate.leave()
                raise
            w.pending_prefill -= prefill
            return Ticket(w, resp, chunks, first, routed.reason, routed.cached_tokens)
        raise self._exhausted(last)

    def close(self, ticket: Ticket) -> None:
        ticket.worker.closed()
        ticket.response.close()
        self.gate.leave()

    def untried(self, gen: GenerateRequest, tried: set[str]) -> list[WorkerState]:
        """The known workers that hold `gen`'s model and are not in `tried`, routable now or not."""
        return [w for w in self.pool.workers.values() if w.worker_id not in tried and holds(w, gen.model)]

    async def _admit(self, gen: GenerateRequest, tried: set[str], since: float | None = None):
        chosen: dict = {}

        async def route():
            now = time.monotonic()
            workers = [w for w in self.untried(gen, tried) if w.routable(now)]
            if not workers:
                chosen.clear()
                return None, self._admission_request(gen, 0)
            t0 = time.perf_counter()
            with self.tracer.start_as_current_span(tm.SPAN_ROUTE) as span:
                result = await self.router.choose(workers, gen)
                span.set_attribute(tm.PULSE_ROUTE_REASON, result.reason)
                if result.worker is not None:
                    span.set_attribute(tm.PULSE_WORKER, result.worker.worker_id)
                span.set_attribute(tm.PULSE_PREFIX_MATCHED_TOKENS, result.cached_tokens)
            self.metrics.routed(time.perf_counter() - t0, result.cpu_s)
            self.metrics.prefix_lookup(result.lookup_s, result.cached_tokens, len(gen.prompt_ids))
            chosen["result"] = result
            if result.worker is None:
                return None, self._admission_request(gen, result.cached_tokens)
            return result.load, self._admission_request(gen, result.cached_tokens, result.worker.info.context_length)

        async def recheck():
            """A queued request behind the head: the worker its last routing chose, if it is still routable (else
            a new routing), with the load that routing saw; it can only be refused, not admitted, from here."""
            result = chosen.get("result")
            w = None if result is None else result.worker
            if w is None or self.pool.workers.get(w.worker_id) is not w or not w.routable(time.monotonic()):
                return await route()
            return result.load, self._admission_request(gen, result.cached_tokens, w.info.context_length)

        with self.tracer.start_as_current_span(tm.SPAN_ADMISSION) as span:
            decision = await self.gate.enter(route, gen.priority or 0, gen.tenant, recheck, since=since)
            span.set_attribute(tm.PULSE_ADMISSION_RESULT, decision.action if decision.action == "admit"
                               else (decision.code or decision.action))
        if decision.action != "admit" or not chosen.get("result") or chosen["result"].worker is None:
            self.metrics.rejected(decision.code or "no_worker")
            headers = {"Retry-After": str(decision.retry_after_s)} if decision.retry_after_s else {}
            status = decision.status or 503
            raise APIError(status, decision.message or "no worker can take this request now",
                           code=decision.code or "no_healthy_worker", headers=headers)
        return chosen["result"]

    def _admission_request(self, gen: GenerateRequest, cached: int, context_length: int = 0) -> AdmissionRequest:
        """`context_length`: the chosen worker's window (its model's); 0: the gateway's default model's."""
        return AdmissionRequest(prompt_tokens=len(gen.prompt_ids), max_tokens=gen.max_tokens, cached_tokens=cached,
                                priority=gen.priority or 0, context_length=context_length or self.context_length)

    async def _first(self, w: WorkerState, resp, chunks) -> list[Chunk]:
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            resp.close()
            raise BackendError(f"worker {w.worker_id} closed the stream before any output", 503) from None
        except (asyncio.TimeoutError, OSError, ValueError) as e:
            resp.close()
            self.pool.record_failure(w)
            raise BackendError(f"worker {w.worker_id} failed before any output: {e}", 503) from None

    def _remember(self, w: WorkerState, routed) -> None:
        """The chosen worker is about to compute this prompt's blocks: record them now, not when its own
        events arrive (up to a poll interval after its prefill), so a request that shares the prefix and
        comes meanwhile (the next turn, another session's first turn with the same system prompt) sees
        where it is being computed; `pending_prefill_tokens` charges the wait for it. A request the worker
        refuses before its first chunk takes back the blocks it added (`_forget`)."""
        hashes = getattr(routed, "hashes", None)
        if self.index is not None and hashes:
            asyncio.get_running_loop().create_task(self._publish(w.worker_id, hashes))

    def _forget(self, w: WorkerState, routed) -> None:
        """The worker failed before its first chunk: withdraw the provisional entries past the prefix the
        index already had for it (those it held before stay)."""
        hashes = getattr(routed, "hashes", None)
        if self.index is None or not hashes:
            return
        known = -(-routed.cached_tokens // max(1, w.info.block_size))
        if hashes[known:]:
            asyncio.get_running_loop().create_task(self._withdraw(w.worker_id, hashes[known:]))

    async def _withdraw(self, worker_id: str, hashes: list[int]) -> None:
        try:
            await self.index.evict(worker_id, hashes, "gpu")
        except Exception as e:  # the index is a hint; routing works without it
            log.debug("provisional withdraw failed: %s", e)

    async def _publish(self, worker_id: str, hashes: list[int]) -> None:
        try:
            await self.index.publish(worker_id, hashes, "gpu")
        except Exception as e:  # the index is a hint; routing works without it
            log.debug("provisional publish failed: %s", e)

    def _exhausted(self, last: BackendError | None) -> APIError:
        if last is not None and last.status == 429:
            return APIError(429, last.message, code="rate_limited", headers={"Retry-After": "1"})
        if not self.pool.any_healthy():
            return APIError(503, "no healthy worker can serve this request now", code="no_healthy_worker",
                            headers={"Retry-After": "2"})
        return APIError(503, f"no worker could take the request: {last.message if last else 'none routable'}",
                        code="workers_unavailable", headers={"Retry-After": "1"})


def holds(w: WorkerState, model: str) -> bool:
    """Whether worker `w` holds `model` (a worker naming no model, or a request naming none, matches any):
    each model's requests, and so its prefix-cache hits, stay on its own workers."""
    return not model or not w.info.model or w.info.model == model
