"""The gateway's admission queue around the pure policy.admission decision.

    gate = AdmissionGate(cfg.admission)
    decision = await gate.enter(route, priority, tenant)  # route: async () -> (WorkerLoad | None, AdmissionRequest)
    if decision.action == "reject": raise APIError(decision.status, decision.message, code=decision.code,
                                                   headers={"Retry-After": str(decision.retry_after_s)} if ...)
    try: ... send to the worker routing chose in its last `route()` call ...
    finally: gate.leave()                             # a request finished: measure the drain rate, wake the queue

`enter` calls `route()` (route + look up the target's load), asks `admit`, and while the answer is
"queue" it waits in `FairOrder` (priority, then turns across tenants, then arrival) until `leave()`
frees capacity, the poll
interval passes (other gateways' requests finish too), or the deadline passes (then the 429 from
`expired`). Each wake calls `route()` again, so a queued request may go to whichever worker freed up.
Cancellation (client gone) removes the waiter. `depth`, `drain_rate()` are for metrics.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from policy.admission import DrainRate, FairOrder, admit, expired
from policy.config import AdmissionConfig
from policy.types import AdmissionDecision, AdmissionRequest, QueueState, WorkerLoad

Route = Callable[[], Awaitable[tuple[WorkerLoad | None, AdmissionRequest]]]
POLL_SLOWER_PER = 8  # a queued request re-checks every poll_s x (1 + requests ahead of it // this)


class AdmissionGate:
    def __init__(self, cfg: AdmissionConfig, *, poll_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.poll_s = poll_s
        self._clock = clock
        self._drain = DrainRate()
        # heap of (-priority, fair start tag, arrival, wake-up, tenant): the first three order it
        self._waiters: list[tuple[int, float, int, asyncio.Event, str]] = []
        self._order = itertools.count()
        self._fair = FairOrder()

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def drain_rate(self) -> float:
        return self._drain.rate(self._clock())

    def leave(self) -> None:
        """A request finished (or was handed to its worker's own queue): wake the head of the queue."""
        self._drain.record(self._clock())
        if self._waiters:
            self._waiters[0][3].set()

    async def enter(self, route: Route, priority: int = 0, tenant: str = "") -> AdmissionDecision:
        """`tenant`: who the request is charged to for fairness (the API key's id; "" when open)."""
        target, request = await route()
        entry = (*self._fair.tag(priority, tenant), next(self._order), asyncio.Event(), tenant)
        decision = admit(target, request, self._state(ahead_of=entry), self.cfg)
        if decision.action != "queue":
            self._settle(entry, decision)
            return decision
        heapq.heappush(self._waiters, entry)
        self._drain.busy(self._clock(), True)
        deadline = self._clock() + (decision.deadline_s or self.cfg.queue_deadline_s)
        decision = None
        try:
            decision = await self._wait(entry, route, deadline)
            return decision
        finally:
            self._remove(entry)
            self._settle(entry, decision)
            if self._waiters:
                self._waiters[0][3].set()  # the next one re-checks: capacity may remain

    def _settle(self, entry, decision: AdmissionDecision | None) -> None:
        """Advance the fair order's virtual time for a request served; give back the tag of one that was not."""
        if decision is not None and decision.action == "admit":
            self._fair.served(entry[:2])
        else:
            self._fair.withdrawn(entry[:2], entry[4])

    async def _wait(self, entry, route: Route, deadline: float) -> AdmissionDecision:
        poll = self.poll_s
        while True:
            left = deadline - self._clock()
            if left <= 0:
                return expired(self._state(ahead_of=None), self.cfg)
            entry[3].clear()
            try:
                async with asyncio.timeout(min(left, poll)):
                    await entry[3].wait()
            except TimeoutError:
                pass
            target, request = await route()
            state = self._state(ahead_of=entry)
            decision = admit(target, request, state, self.cfg)
            if decision.action != "queue":
                return decision
            # Only the head can be admitted (leave() and the admitted head's successor wake it at once); a
            # request further back re-checks for an early refusal (its worker gone, a drain too slow for its
            # deadline) at a pace that slows with its place: with hundreds queued, every one re-routing every
            # poll_s was most of a gateway replica's event loop (py-spy at 32 clients on 4 slots: 54%).
            poll = self.poll_s * (1 + state.depth // POLL_SLOWER_PER)

    def _state(self, ahead_of) -> QueueState:
        """The queue as `admit` sees it: everyone queued, or only those served before `ahead_of`."""
        waiting = self._waiters if ahead_of is None else [e for e in self._waiters if e[:3] < ahead_of[:3]]
        return QueueState(Counter(-e[0] for e in waiting), self.drain_rate())

    def _remove(self, entry) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            return
        heapq.heapify(self._waiters)
        if not self._waiters:
            self._drain.busy(self._clock(), False)
