"""The dispatcher's fresh load signals, against real worker channels (StreamServer + the load-test backend):

- from the moment a request is routed until its first chunk, its uncached prompt tokens count as the
  chosen worker's pending prefill (what the routing cost charges for the wait) and, with the in-process
  index, its blocks are listed at that worker, so a request sharing the prefix that arrives meanwhile sees
  where it is being computed (not only after the worker's next /blocks poll);
- when the worker refuses before any output, the provisional entries past what the index already knew
  are withdrawn and the pending prefill is given back; a worker that refused for want of a place (429) is
  counted full until its next poll, and the request waits in the queue for a place.
"""
from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from cache.hashing import chain_hashes
from gateway.admission_gate import AdmissionGate
from gateway.dispatch import Dispatcher
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.router import PrefixRouter, load_of
from policy.config import PulseConfig
from tests.integration.gateway_helpers import start_dispatch, stop_dispatch
from tests.waiting import until
from workers.protocol import BackendStats, GenerateRequest

PROMPT = list(range(1000, 1000 + 640))  # 40 blocks of 16


def _config(tokens_per_s: float, slots: int = 64, ttft_s: float = 0.0) -> PulseConfig:
    return PulseConfig.model_validate({"workers": {"backend": "loadtest",
                                                   "loadtest": {"tokens": 4, "tokens_per_s": tokens_per_s,
                                                                "slots": slots, "ttft_s": ttft_s}}})


async def test_a_routed_request_counts_as_pending_prefill_and_is_indexed_before_its_first_chunk():
    servers, pool, index, dispatcher = await start_dispatch(_config(tokens_per_s=2.0, ttft_s=0.5))  # first chunk after ~0.5 s
    try:
        gen = GenerateRequest(request_id="a", prompt_ids=PROMPT, max_tokens=4)
        opening = asyncio.create_task(dispatcher.open(gen))
        await asyncio.sleep(0.15)
        assert not opening.done()
        (w,) = [w for w in pool.workers.values() if w.inflight]
        assert w.pending_prefill == len(PROMPT)
        assert load_of(w).pending_prefill_tokens == len(PROMPT)
        assert await index.longest_prefix(chain_hashes(PROMPT, 16)) == {w.worker_id: 40}
        ticket = await opening
        assert w.pending_prefill == 0 and w.inflight == 1  # prefill done; the stream is still open
        # the decision's own CPU time is recorded beside its wall time, and is no larger
        reg = dispatcher.metrics.registry
        assert reg.get_sample_value("pulse_router_decision_cpu_seconds_count") == 1
        cpu = reg.get_sample_value("pulse_router_decision_cpu_seconds_sum")
        assert 0 < cpu <= reg.get_sample_value("pulse_router_decision_seconds_sum")
        dispatcher.close(ticket)
        assert w.inflight == 0
    finally:
        await stop_dispatch(servers, pool)


async def test_a_refusal_before_output_withdraws_the_provisional_blocks_and_a_full_worker_is_waited_for():
    servers, pool, index, dispatcher = await start_dispatch(_config(tokens_per_s=4.0, slots=1), n=1)
    (w,) = pool.workers.values()
    try:
        await index.publish(w.worker_id, chain_hashes(PROMPT, 16)[:10])  # the worker really holds 10 blocks
        busy = await dispatcher.open(GenerateRequest(request_id="busy", prompt_ids=list(range(5, 40)), max_tokens=4))
        # its one slot is taken (the gateway's view, polled before, said free): it refuses (429) before any output
        b = asyncio.create_task(dispatcher.open(GenerateRequest(request_id="b", prompt_ids=PROMPT, max_tokens=4)))
        # the 429's round trip, then the withdrawal's task (a fixed 0.3 s was not always enough on a loaded CI box)
        await until(lambda: w.refused)
        await until(lambda: index.longest_prefix(chain_hashes(PROMPT, 16)), {w.worker_id: 10})
        assert w.pending_prefill == 0 and w.inflight == 1
        # full, not gone: the request waits in the queue for its place (it was a 503 "no healthy worker")
        assert not b.done() and w.refused and dispatcher.gate.depth == 1
        dispatcher.close(busy)
        await asyncio.sleep(0.1)
        assert not b.done()  # counted full until the next poll says otherwise
        await pool.poll_once()
        ticket = await asyncio.wait_for(b, 5)
        assert ticket.worker is w and not w.refused
        await _finish(dispatcher, ticket)
    finally:
        await stop_dispatch(servers, pool)


async def test_a_worker_that_does_not_hold_the_model_is_skipped_not_returned_to_the_client():
    """The gateway's view says both workers hold m-a, but w1 holds m-b (restarted with another model):
    a request routed there (its prefix is indexed at w1, so the router prefers it) gets w1's 421 and is
    opened on w0 instead of failing."""
    servers, pool, index, dispatcher = await start_dispatch(_config(tokens_per_s=200.0),
                                                    models=[("m-a", "m-a"), ("m-b", "m-a")])
    try:
        await index.publish("w1", chain_hashes(PROMPT, 16), "gpu")
        gen = GenerateRequest(request_id="a", prompt_ids=PROMPT, max_tokens=4, model="m-a")
        assert (await dispatcher.router.choose(list(pool.routable()), gen)).worker.worker_id == "w1"
        ticket = await dispatcher.open(gen)
        assert ticket.worker.worker_id == "w0"
        assert ticket.first and not ticket.first[0].error
        dispatcher.close(ticket)
    finally:
        await stop_dispatch(servers, pool)


async def _finish(dispatcher: Dispatcher, ticket) -> None:
    """Read a stream to its end (the worker's generation is over), then close it as the relay does."""
    async for _ in ticket.chunks:
        pass
    dispatcher.close(ticket)


async def test_a_finished_request_stops_counting_before_the_next_poll():
    """The stats poll saw this gateway's request running; once it ends, the worker's load drops at once
    (the next request to the prefix holder must not see it busy until the next poll, 0.5 s later)."""
    servers, pool, _index, dispatcher = await start_dispatch(_config(tokens_per_s=200.0), n=1)  # poll_interval 30 s
    (w,) = pool.workers.values()
    try:
        ticket = await dispatcher.open(GenerateRequest(request_id="a", prompt_ids=PROMPT, max_tokens=4))
        await pool.poll_once()
        assert w.stats.running == 1 and load_of(w).active == 1
        await _finish(dispatcher, ticket)
        assert servers[0].backend.running == 0 and w.stats.running == 1  # the polled figure is stale
        assert load_of(w).active == 0
        await pool.poll_once()
        assert load_of(w).active == 0
    finally:
        await stop_dispatch(servers, pool)


async def test_another_replicas_requests_count_through_the_poll_and_ours_at_once():
    """Two gateway replicas (two pools and dispatchers) on one worker: the other's request is seen only
    through the poll; this one's own request counts from its routing to its end, on top of it."""
    servers, pool, _index, dispatcher = await start_dispatch(_config(tokens_per_s=20.0), n=1)
    other_pool = WorkerPool(pool._discover, poll_interval_s=30)
    await other_pool.start()
    other = Dispatcher(other_pool, PrefixRouter(None, PulseConfig().routing), AdmissionGate(PulseConfig().admission),
                       GatewayMetrics(CollectorRegistry()), trace.get_tracer("test"), context_length=32768)
    (w,) = pool.workers.values()
    try:
        theirs = await other.open(GenerateRequest(request_id="theirs", prompt_ids=[1, 2, 3], max_tokens=4))
        assert load_of(w).active == 0  # not polled yet: this replica cannot know
        await pool.poll_once()
        assert load_of(w).active == 1
        ours = await dispatcher.open(GenerateRequest(request_id="ours", prompt_ids=[4, 5, 6], max_tokens=4))
        assert load_of(w).active == 2
        await pool.poll_once()
        assert (w.stats.running, w.polled_own, load_of(w).active) == (2, 1, 2)
        await _finish(dispatcher, ours)
        assert load_of(w).active == 1  # theirs, as last polled
        await _finish(other, theirs)
        await pool.poll_once()
        assert load_of(w).active == 0
    finally:
        await other_pool.close()
        await stop_dispatch(servers, pool)


async def test_the_polled_share_is_the_peak_in_flight_since_the_poll_before():
    """The worker's figure may be older than its answer (the engine process reports it every 50 ms): what it
    counted of this gateway's is taken as the most this gateway had in flight from the poll before to this
    poll's answer, so a request that ended just before the poll does not count twice."""
    servers, pool, _index, dispatcher = await start_dispatch(_config(tokens_per_s=200.0), n=1)
    (w,) = pool.workers.values()
    try:
        tickets = [await dispatcher.open(GenerateRequest(request_id=f"r{i}", prompt_ids=[i + 1], max_tokens=4))
                   for i in range(3)]
        for t in tickets:
            await _finish(dispatcher, t)
        await pool.poll_once()
        assert w.polled_own == 3  # the peak since the poll before
        w.stats = BackendStats(running=3, slots=64)  # what a worker whose figure lags its answer could have said
        assert load_of(w).active == 0
        await pool.poll_once()
        assert w.polled_own == 0 and load_of(w).active == 0  # a quiet interval: nothing of ours to subtract
    finally:
        await stop_dispatch(servers, pool)


async def _two_replicas(queue_deadline_s: float = 30.0, tokens_per_s: float = 4.0):
    """This replica's dispatcher, and another replica's request holding the worker's one place (4 tokens at
    `tokens_per_s`), which this replica's view (polled before it) does not show."""
    config = _config(tokens_per_s=tokens_per_s, slots=1)
    config.admission.queue_deadline_s = queue_deadline_s
    servers, pool, _index, dispatcher = await start_dispatch(config, n=1)
    other_pool = WorkerPool(pool._discover, poll_interval_s=30)
    await other_pool.start()
    other = Dispatcher(other_pool, PrefixRouter(None, PulseConfig().routing), AdmissionGate(PulseConfig().admission),
                       GatewayMetrics(CollectorRegistry()), trace.get_tracer("test"), context_length=32768)
    await pool.poll_once()
    theirs = await other.open(GenerateRequest(request_id="theirs", prompt_ids=[1, 2, 3], max_tokens=4))
    return servers, pool, dispatcher, other_pool, other, theirs


async def _stale_polls(dispatcher: Dispatcher, w, times: int, task: asyncio.Task) -> int:
    """Refused, then told by a poll that the place is free (another replica took it again meanwhile), `times`
    times or until `task` ends; returns how many refusals there were."""
    refusals = 0
    while refusals < times and not task.done():
        await until(lambda: w.refused or task.done())
        if task.done():
            break
        refusals += 1
        w.refused = False
        dispatcher.gate.wake()
    return refusals


async def test_a_request_refused_more_times_than_its_retries_waits_on_for_its_place():
    """A refusal is this replica's stale view, not the worker failing: another replica winning the race for the
    place a poll showed free more often than max_retries in a row sent the worker's own 429 to the client (CI,
    tests/integration/test_replica_shares.py). The request waits in the queue until it gets a place."""
    servers, pool, dispatcher, other_pool, other, theirs = await _two_replicas()
    (w,) = pool.workers.values()
    try:
        ours = asyncio.create_task(dispatcher.open(GenerateRequest(request_id="ours", prompt_ids=[4], max_tokens=4)))
        assert await _stale_polls(dispatcher, w, dispatcher.max_retries + 3, ours) == dispatcher.max_retries + 3
        await until(lambda: w.refused)
        assert not ours.done() and dispatcher.gate.depth == 1
        await _finish(other, theirs)
        await pool.poll_once()
        ticket = await asyncio.wait_for(ours, 5)
        assert ticket.worker is w
        await _finish(dispatcher, ticket)
    finally:
        await other_pool.close()
        await stop_dispatch(servers, pool)


async def test_refusals_end_at_the_queue_deadline_counted_from_the_first_try():
    servers, pool, dispatcher, other_pool, other, theirs = await _two_replicas(queue_deadline_s=1.0, tokens_per_s=1.0)
    (w,) = pool.workers.values()
    try:
        t0 = asyncio.get_running_loop().time()
        ours = asyncio.create_task(dispatcher.open(GenerateRequest(request_id="ours", prompt_ids=[4], max_tokens=4)))
        assert await _stale_polls(dispatcher, w, 1000, ours) > dispatcher.max_retries + 1
        with pytest.raises(APIError) as e:
            await ours
        took = asyncio.get_running_loop().time() - t0
        assert e.value.status == 429 and "Waited 1 s in the queue" in e.value.message, e.value.message
        assert 1.0 <= took < 3.0, took
        await _finish(other, theirs)
    finally:
        await other_pool.close()
        await stop_dispatch(servers, pool)
