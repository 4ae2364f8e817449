"""gateway.admission_gate: the asyncio queue around policy.admission, on a simulated worker's slots."""
from __future__ import annotations

import asyncio

import pytest

from gateway.admission_gate import RECHECK_MAX_S, AdmissionGate, recheck_s
from policy.config import AdmissionConfig
from policy.types import AdmissionRequest, WorkerLoad


class Worker:
    """A worker with `slots` slots; `running` is what the gateway has sent it."""

    def __init__(self, slots: int):
        self.slots, self.running, self.peak = slots, 0, 0

    def route(self, priority: int = 0):
        async def route():
            load = WorkerLoad("w", slots=self.slots, inflight=self.running)
            return load, AdmissionRequest(10, 10, priority=priority)

        return route


async def serve(gate: AdmissionGate, worker: Worker, order: list, name: str, priority: int = 0, hold_s=0.02,
                tenant: str = ""):
    d = await gate.enter(worker.route(priority), priority, tenant)
    if d.action != "admit":
        order.append((name, d.status))
        return d
    worker.running += 1  # before any await: the next waiter must see it
    worker.peak = max(worker.peak, worker.running)
    order.append((name, 200))
    try:
        await asyncio.sleep(hold_s)
    finally:
        worker.running -= 1
        gate.leave()
    return d


async def test_queue_holds_slots_and_serves_by_priority():
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=10), poll_s=1.0)
    worker, order = Worker(slots=2), []
    # the first two hold their slots long enough for the rest to queue even on a loaded box
    first = [asyncio.create_task(serve(gate, worker, order, f"a{i}", hold_s=0.3)) for i in range(2)]
    await asyncio.sleep(0.01)
    later = [asyncio.create_task(serve(gate, worker, order, f"low{i}", priority=-1)) for i in range(2)]
    await asyncio.sleep(0.005)
    later += [asyncio.create_task(serve(gate, worker, order, f"high{i}", priority=5)) for i in range(2)]
    await asyncio.sleep(0.005)
    assert gate.depth == 4
    await asyncio.gather(*first, *later)
    assert worker.peak == 2 and gate.depth == 0
    assert [n for n, _ in order] == ["a0", "a1", "high0", "high1", "low0", "low1"]
    assert {s for _, s in order} == {200}
    assert gate.drain_rate() > 0


async def test_a_flooding_tenant_does_not_starve_another():
    """Tenant A holds the slot and queues 30 requests, then tenant B queues 2: B's are served in turns
    with A's, not after all of A's."""
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=100), poll_s=1.0)
    worker, order = Worker(slots=1), []
    hog = asyncio.create_task(serve(gate, worker, order, "hog", hold_s=0.2, tenant="A"))
    await asyncio.sleep(0.01)
    tasks = [asyncio.create_task(serve(gate, worker, order, f"A{i}", hold_s=0.005, tenant="A")) for i in range(30)]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(serve(gate, worker, order, f"B{i}", hold_s=0.005, tenant="B")) for i in range(2)]
    await asyncio.sleep(0.01)
    assert gate.depth == 32
    await asyncio.gather(hog, *tasks)
    names = [n for n, _ in order]
    # A's hog had the last turn, so B goes next, then they alternate
    assert names[:5] == ["hog", "B0", "A0", "B1", "A1"], names[:8]
    assert worker.peak == 1 and {s for _, s in order} == {200}


async def test_deadline_gives_429_with_retry_after():
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_deadline_s=0.1), poll_s=0.02)
    worker, order = Worker(slots=1), []
    hog = asyncio.create_task(serve(gate, worker, order, "hog", hold_s=0.5))
    await asyncio.sleep(0.01)
    d = await gate.enter(worker.route())
    assert (d.action, d.status, d.code) == ("reject", 429, "server_overloaded") and d.retry_after_s >= 1
    assert gate.depth == 0
    await hog


async def test_full_queue_rejects_at_once_and_cancel_leaves_the_queue():
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=1), poll_s=1.0)
    worker, order = Worker(slots=1), []
    hog = asyncio.create_task(serve(gate, worker, order, "hog", hold_s=0.2))
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(gate.enter(worker.route()))
    await asyncio.sleep(0.01)
    d = await asyncio.wait_for(gate.enter(worker.route()), 0.05)
    assert (d.action, d.status) == ("reject", 429)
    waiter.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.depth == 0
    await hog


async def test_no_worker_is_503_without_queueing():
    gate = AdmissionGate(AdmissionConfig())

    async def nowhere():
        return None, AdmissionRequest(10, 10)

    d = await gate.enter(nowhere)
    assert (d.action, d.status, d.code) == ("reject", 503, "no_healthy_worker") and gate.depth == 0


async def test_a_deep_queue_re_routes_at_a_pace_set_by_place_not_every_poll():
    """Only the head can be admitted; requests further back re-check (for an early refusal) more rarely the
    further back they are. 64 queued behind a full worker for 0.5 s at poll_s 10 ms: every one re-routing
    every poll would be ~3,200 route() calls; in steps of 8 places (the pace before) ~1,100; one by one ~240."""
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=100, queue_deadline_s=30), poll_s=0.01)
    worker, calls = Worker(slots=1), [0]
    worker.running = 1  # full: nobody is admitted while we count

    def counting_route():
        inner = worker.route()

        async def route():
            calls[0] += 1
            return await inner()

        return route

    waiters = [asyncio.create_task(gate.enter(counting_route())) for _ in range(64)]
    await asyncio.sleep(0.05)
    assert gate.depth == 64
    calls[0] = 0
    await asyncio.sleep(0.5)
    assert calls[0] < 0.12 * 64 * 50, calls[0]
    assert calls[0] > 50  # the head still polls at poll_s
    worker.running = 0  # the slot frees: the head goes at once, and each admitted one wakes the next
    gate.leave()
    for _ in range(64):
        done, _ = await asyncio.wait(waiters, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        assert done, "the next head was not woken"
        for t in done:
            waiters.remove(t)
            assert t.result().action == "admit"
            gate.leave()
        if not waiters:
            break
    assert not waiters


def test_the_re_check_pace_never_exceeds_the_steps_of_eight():
    """Deep queues (hundreds) keep the old pace; nobody behind the head re-checks more often than it did."""
    for ahead in range(0, 2000, 7):
        old = 0.05 * (1 + ahead // 8)
        assert recheck_s(0.05, ahead) >= old
        assert recheck_s(0.05, ahead) <= max(RECHECK_MAX_S, old)  # an early refusal within a second, or as before


async def test_waiters_behind_the_head_re_check_without_routing_and_are_still_refused_early():
    """With `recheck`, only the head routes while it waits (a whole decision: hashes, index, loads); the others
    re-check the last routing's target, which is enough to be refused (they cannot be admitted behind the head),
    and each still routes once it is the head."""
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=100, queue_deadline_s=30), poll_s=0.01)
    worker, routes, rechecks = Worker(slots=1), [0], [0]
    worker.running = 1
    gone = [False]  # the worker left: a re-check then sees no target

    def calls():
        inner = worker.route()

        async def route():
            routes[0] += 1
            return await inner()

        async def recheck():
            rechecks[0] += 1
            load, request = await inner()
            return (None if gone[0] else load), request

        return route, recheck

    waiters = []
    for _ in range(16):
        route, recheck = calls()
        waiters.append(asyncio.create_task(gate.enter(route, 0, "", recheck)))
    await asyncio.sleep(0.05)
    assert gate.depth == 16
    routes[0] = rechecks[0] = 0
    await asyncio.sleep(0.5)
    assert rechecks[0] > 16  # everyone behind the head re-checked at least once
    assert routes[0] <= 0.5 / 0.01 + 5, routes[0]  # the head's polls only
    gone[0] = True  # those behind the head learn it at their next re-check: 503, not a wait to the deadline
    for _ in range(500):
        if gate.depth == 1:
            break
        await asyncio.sleep(0.01)
    assert gate.depth == 1  # the head, whose own routing still finds the (full) worker
    refused = [t.result() for t in waiters if t.done()]
    assert len(refused) == 15 and {(d.status, d.code) for d in refused} == {(503, "no_healthy_worker")}
    for t in waiters:
        t.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_head_waiting_for_its_own_places_asks_for_no_stats_and_the_poll_wakes_one_that_does():
    """The head of the queue says whether it waits for what only the workers' next stats show (the gateway polls
    fast only then): not when the places it waits for are this gateway's own requests, whose ends wake it; yes
    when another replica's requests hold them. After a poll (`wake`) the head re-checks at once, not after its own
    timer (here 10 s)."""
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=10, queue_deadline_s=30), poll_s=10,
                         head_poll_s=10)
    worker, order = Worker(slots=1), []
    assert not gate.needs_stats()  # nothing waits
    hog = asyncio.create_task(serve(gate, worker, order, "hog", hold_s=0.2))
    await asyncio.sleep(0.01)
    own = asyncio.create_task(serve(gate, worker, order, "own"))
    await asyncio.sleep(0.01)
    assert gate.depth == 1 and not gate.needs_stats()  # the hog is this gateway's: its end wakes the head
    await asyncio.wait_for(asyncio.gather(hog, own), 2.0)  # leave() woke it, long before its 10 s timer
    assert [n for n, _ in order] == ["hog", "own"] and not gate.needs_stats()

    others = [1]  # a place another gateway's request holds, as the worker's stats said

    async def shared():
        load = WorkerLoad("w", slots=1, running=others[0], inflight=0, polled_inflight=0, other_gateways=1)
        return load, AdmissionRequest(10, 10)

    waiter = asyncio.create_task(gate.enter(shared))
    await asyncio.sleep(0.01)
    assert gate.depth == 1 and gate.needs_stats()  # only a poll can show that place free
    others[0] = 0  # the next poll's news
    gate.wake()
    d = await asyncio.wait_for(waiter, 1.0)
    assert d.action == "admit" and gate.depth == 0 and not gate.needs_stats()


async def test_a_place_freed_while_the_head_routes_is_not_lost():
    """The head routes (an await: the prefix index, the loads) on the state before a request leaves; the leave()
    during that routing must wake it again at once, not after its timer (10 s here)."""
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=10, queue_deadline_s=30), poll_s=10,
                         head_poll_s=10)
    worker = Worker(slots=1)
    worker.running = 1
    routing = asyncio.Event()

    async def slow_route():
        load = WorkerLoad("w", slots=1, inflight=worker.running)  # read before the await, as routing does
        routing.set()
        await asyncio.sleep(0.05)
        return load, AdmissionRequest(10, 10)

    waiter = asyncio.create_task(gate.enter(slow_route))
    await asyncio.wait_for(routing.wait(), 1)  # the first routing: full, it queues
    await asyncio.sleep(0.1)
    assert gate.depth == 1
    routing.clear()
    gate.wake()  # a poll: the head re-routes ...
    await asyncio.wait_for(routing.wait(), 1)
    worker.running = 0  # ... and while it does, the request holding the place ends
    gate.leave()
    d = await asyncio.wait_for(waiter, 2.0)
    assert d.action == "admit"


async def test_the_gate_tells_each_worker_its_first_request_for_it_and_how_long_it_has_waited():
    """`heads()` is what the stats poll tells each worker (policy.admission.gateway_order): per worker, the first
    request in the queue's order whose last routing chose it, its priority and its wait since it first came (for a
    request back from a worker's refusal, since it first entered)."""
    now = [100.0]
    gate = AdmissionGate(AdmissionConfig(worker_queue_max=0, queue_max=10, queue_deadline_s=30), poll_s=10,
                         head_poll_s=10, clock=lambda: now[0])

    def full(worker_id: str, priority: int = 0):
        async def route():
            return WorkerLoad(worker_id, slots=1, running=1), AdmissionRequest(10, 10, priority=priority)
        return route

    assert gate.heads() == {}
    waiters = [asyncio.create_task(gate.enter(full("a"), 0, "t1"))]
    await asyncio.sleep(0.01)
    now[0] = 101.0
    waiters.append(asyncio.create_task(gate.enter(full("a", 2), 2, "t2")))  # behind in time, ahead in order
    waiters.append(asyncio.create_task(gate.enter(full("b"), 0, "t3", since=99.5)))  # refused once: came at 99.5
    await asyncio.sleep(0.01)
    now[0] = 102.0
    assert gate.depth == 3
    assert gate.heads() == {"a": (2, 1.0), "b": (0, 2.5)}
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert gate.heads() == {}
