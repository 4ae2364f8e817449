"""The gateway's admission queue around the pure policy.admission decision.

    gate = AdmissionGate(cfg.admission)
    decision = await gate.enter(route, priority, tenant)  # route: async () -> (WorkerLoad | None, AdmissionRequest)
    if decision.action == "reject": raise APIError(decision.status, decision.message, code=decision.code,
                                                   headers={"Retry-After": str(decision.retry_after_s)} if ...)
    try: ... send to the worker routing chose in its last `route()` call ...
    finally: gate.leave()                             # a request finished: measure the drain rate, wake the queue

`enter` calls `route()` (route + look up the target's load), asks `admit`, and while the answer is
"queue" it waits in `FairOrder` (priority, then turns across tenants, then arrival) until `leave()`
frees capacity, `wake()` says the workers' stats were polled (other gateways' requests finish too; the
gateway's WorkerPool polls fast only while `needs_stats()`), its timer passes, or the deadline passes (then
the 429 from `expired`). Each wake of the head calls `route()` again, so a queued request may go to whichever
worker freed up; a waiter behind it calls `recheck()` where given (dispatch: its last routing's target, no new
decision). Cancellation (client gone) removes the waiter. `depth`, `drain_rate()` are for metrics; `heads()` is what
the stats poll tells each worker of this queue (its first request for that worker: priority and wait), so that the
gateway replicas sharing a worker let each other's older heads go first (policy.admission.gateway_order).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from policy.admission import DrainRate, FairOrder, admit, expired, waits_on_stats
from policy.config import AdmissionConfig
from policy.types import AdmissionDecision, AdmissionRequest, QueueState, WorkerLoad

Route = Callable[[], Awaitable[tuple[WorkerLoad | None, AdmissionRequest]]]
RECHECK_MAX_S = 1.0  # a request further back re-checks every poll_s x (1 + requests ahead of it), at most this
POLL_SLOWER_PER = 8  # ... unless poll_s x (1 + ahead // this) is longer (a queue of hundreds)


class AdmissionGate:
    def __init__(self, cfg: AdmissionConfig, *, poll_s: float = 0.05, head_poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`head_poll_s`: how long the head waits unwoken before it re-routes (None: `poll_s`); where the stats
        poll wakes it (`wake`, WorkerPool.on_polled), the poll's plain interval is enough."""
        self.cfg = cfg
        self.poll_s = poll_s
        self.head_poll_s = poll_s if head_poll_s is None else head_poll_s
        self._clock = clock
        self._drain = DrainRate()
        # heap of (-priority, fair start tag, arrival, wake-up, tenant, [its last routing's worker id or None, when
        # it came]): the first three order it
        self._waiters: list[tuple[int, float, int, asyncio.Event, str, list]] = []
        self._order = itertools.count()
        self._fair = FairOrder()
        # (the head, whether it waits for what only the workers' next stats show: policy.admission.waits_on_stats)
        # as of its last check; a head that has not checked since it became the head is taken to wait on them
        self._head_waits: tuple[object, bool] = (None, True)

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def drain_rate(self) -> float:
        return self._drain.rate(self._clock())

    def leave(self) -> None:
        """A request finished (or was handed to its worker's own queue): wake the head of the queue."""
        self._drain.record(self._clock())
        self.wake()

    def wake(self) -> None:
        """The head of the queue re-checks now (a request left, or the workers' stats were polled)."""
        if self._waiters:
            self._waiters[0][3].set()

    def needs_stats(self) -> bool:
        """Whether requests wait for what only the workers' next stats can show (WorkerPool.poll_delay polls fast
        then): a place another gateway's request holds, KV the worker frees, a refusal to clear. A head that
        waits only for places this gateway's own requests hold is woken by `leave` when one ends."""
        if not self._waiters:
            return False
        head, waits = self._head_waits
        return waits or head is not self._waiters[0]

    def now(self) -> float:
        return self._clock()

    async def enter(self, route: Route, priority: int = 0, tenant: str = "", recheck: Route | None = None,
                    *, since: float | None = None) -> AdmissionDecision:
        """`tenant`: who the request is charged to for fairness (the API key's id; "" when open). `recheck`: what a
        waiter behind the head calls instead of `route` (the last routing's target with what it now knows of its
        health, no new decision): such a waiter cannot be admitted, only refused early, so a whole routing
        decision (the prompt's hashes, the index, every worker's load) each time it re-checks is wasted work.
        `since`: when the request first entered (`now()`), for one back from a worker's refusal: its deadline
        runs from then, not from now, and once it has passed the request is refused (the queue's 429) before it
        routes again; a request refused each time a place looks free is bounded by its deadline, not a count."""
        if since is not None and self._clock() - since >= self.cfg.queue_deadline_s:
            return expired(self._state(ahead_of=None), self.cfg)
        target, request = await route()
        came = self._clock() if since is None else since
        entry = (*self._fair.tag(priority, tenant), next(self._order), asyncio.Event(), tenant,
                 [_target_id(target), came])
        decision = admit(target, request, self._state(ahead_of=entry), self.cfg)
        if decision.action != "queue":
            self._settle(entry, decision)
            return decision
        heapq.heappush(self._waiters, entry)
        self._note_head(entry, target, request)
        self._drain.busy(self._clock(), True)
        deadline = came + (decision.deadline_s or self.cfg.queue_deadline_s)
        decision = None
        try:
            decision = await self._wait(entry, route, deadline, recheck)
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

    async def _wait(self, entry, route: Route, deadline: float, recheck: Route | None) -> AdmissionDecision:
        poll = self.head_poll_s if self._waiters[0] is entry else self.poll_s
        while True:
            left = deadline - self._clock()
            if left <= 0:
                return expired(self._state(ahead_of=None), self.cfg)
            try:
                async with asyncio.timeout(min(left, poll)):
                    await entry[3].wait()
            except TimeoutError:
                pass
            # cleared before routing, not before the next wait: a request that leaves (or a poll) while this one
            # routes wakes it again at once; cleared after, that news was lost until the timer (up to head_poll_s)
            entry[3].clear()
            behind = recheck is not None and bool(self._waiters) and self._waiters[0] is not entry
            target, request = await (recheck() if behind else route())
            state = self._state(ahead_of=entry)
            decision = admit(target, request, state, self.cfg)
            if behind and decision.action == "admit":  # not expected behind the head; never on a stale view
                target, request = await route()
                decision = admit(target, request, state, self.cfg)
            if decision.action != "queue":
                return decision
            entry[5][0] = _target_id(target)
            self._note_head(entry, target, request)
            poll = self.head_poll_s if state.depth == 0 else recheck_s(self.poll_s, state.depth)

    def _note_head(self, entry, target: WorkerLoad | None, request: AdmissionRequest) -> None:
        """`entry` was just queued (again) on `target`'s load: if it is the head, whether it waits on the stats."""
        if self._waiters[0] is entry:
            self._head_waits = (entry, waits_on_stats(target, request, self.cfg))

    def _state(self, ahead_of) -> QueueState:
        """The queue as `admit` sees it: everyone queued, or only those served before `ahead_of` (and when it came)."""
        waiting = self._waiters if ahead_of is None else [e for e in self._waiters if e[:3] < ahead_of[:3]]
        return QueueState(Counter(-e[0] for e in waiting), self.drain_rate(), queued=len(self._waiters),
                          since=None if ahead_of is None else ahead_of[5][1])

    def heads(self) -> dict[str, tuple[int, float]]:
        """Per worker, the first queued request (in the queue's order) whose last routing chose it: its priority
        and how long it has waited. The gateway tells each worker its own (WorkerPool's stats poll) so that the
        replicas that share the worker serve its places in one order (policy.admission.gateway_order)."""
        now, first = self._clock(), {}
        for e in self._waiters:
            worker = e[5][0]
            if worker is not None and (worker not in first or e[:3] < first[worker][:3]):
                first[worker] = e
        return {worker: (-e[0], max(0.0, now - e[5][1])) for worker, e in first.items()}

    def _remove(self, entry) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            return
        heapq.heapify(self._waiters)
        if not self._waiters:
            self._drain.busy(self._clock(), False)


def recheck_s(poll_s: float, ahead: int) -> float:
    """How long a queued request with `ahead` requests before it waits before it re-routes unwoken.

    Only the head can be admitted, and leave() and the admitted head's successor wake it at once; it polls every
    `poll_s` for capacity that other gateway replicas' requests free. A request further back re-checks only for an
    early refusal (its worker gone, a drain too slow for its deadline), which can wait: every re-check is a whole
    routing decision (the prompt's hashes, the index, the loads). With hundreds queued, every one re-routing every
    poll_s was most of a gateway replica's event loop (py-spy at 32 clients on 4 slots: 54%); paced by place in
    steps of 8 it was still ~400 decisions a second for 56 queued behind llama-server's 8 places on the CPU box.
    Paced by place one by one, up to RECHECK_MAX_S, it is ~110, and never more than the steps of 8 gave at any
    depth: the replica's CPU per served request there (64 clients, 16 tokens each) fell from 10.0-12.8 ms to
    6.7-8.8 (bench/llama_server_parity.py, BENCHMARKS)."""
    if ahead == 0:
        return poll_s
    return min(poll_s * (1 + ahead), max(RECHECK_MAX_S, poll_s * (1 + ahead // POLL_SLOWER_PER)))


def _target_id(target: WorkerLoad | None) -> str | None:
    return None if target is None else target.worker_id
