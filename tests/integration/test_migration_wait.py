"""A hand-over when no other worker is routable at that moment (gateway/migration.py), against real worker
channels (StreamServer + the load-test backend) and the real pool, dispatcher and relay:

- another worker of the model is known but unhealthy on its last poll (here: draining; in the field its
  llama-server restarting or a poll that timed out on a loaded box): the stream waits for it, and when its
  next poll finds it healthy the stream goes on there, every token once, in order;
- it stays unhealthy: the stream ends with one error chunk once `wait_s` has passed, not before;
- no other worker is known (one worker, the single-box default): the stream waits for that worker to be routable
  again (in the field: Ray restarting the actor, the worker restarting its engine or llama-server) and goes on
  there; a worker takes a stream back only once, so a second failure there ends it at once.

The first worker's stream is cut by aborting its TCP connections, as a killed process's are.
"""
from __future__ import annotations

import asyncio
import time

from gateway.migration import Relay
from policy.config import PulseConfig
from tests.integration.gateway_helpers import start_dispatch, stop_dispatch
from tests.waiting import until
from workers.protocol import GenerateRequest
from workers.stream import StreamServer

TOKENS = 40
CONFIG = PulseConfig.model_validate({"workers": {"backend": "loadtest",
                                                 "loadtest": {"tokens": TOKENS, "tokens_per_s": 50.0}}})


def _cut(server: StreamServer) -> None:
    """Every connection to the worker dropped at once, as when its process is killed."""
    for handler in list(server._runner.server.connections):
        if handler.transport is not None:
            handler.transport.abort()


async def _stream_cut_after_5(servers, pool, dispatcher, wait_s: float, before_cut=None):
    """Open a stream (on w0: the only routable worker), cut w0 after 5 tokens (`before_cut()` awaited just
    before); returns (the relay, the task collecting its chunks, the chunks so far, when the cut was)."""
    gen = GenerateRequest(request_id="r", prompt_ids=list(range(100, 164)), max_tokens=TOKENS)
    ticket = await dispatcher.open(gen)
    assert ticket.worker.worker_id == "w0"
    relay = Relay(dispatcher, gen, ticket, dispatcher.metrics, wait_s=wait_s)
    chunks: list = []

    async def collect():
        async for batch in relay.batches():
            chunks.extend(batch)

    task = asyncio.create_task(collect())
    await until(lambda: sum(len(c.token_ids) for c in chunks) >= 5, what="the first 5 tokens")
    if before_cut is not None:
        await before_cut()
    _cut(servers[0])
    return relay, task, chunks, time.monotonic()


def _migrations(dispatcher, outcome: str) -> float:
    registry = dispatcher.metrics.registry
    return registry.get_sample_value("pulse_stream_migrations_total", {"outcome": outcome}) or 0.0


async def _held_until_back_then_whole(server: StreamServer, pool, dispatcher, relay, task, chunks) -> None:
    """The cut stream is still open a second later; once `server` is healthy again (undrained, polled) it goes on
    there: every token once, in order, one hand-over."""
    await asyncio.sleep(1.0)
    assert not task.done(), f"the stream ended while a known worker could still come back: {chunks[-1:]}"
    server.draining = False
    await pool.poll_once()
    await asyncio.wait_for(task, 10)
    relay.close()
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == [1000 + i for i in range(TOKENS)]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == TOKENS
    assert relay.migrations == 1 and _migrations(dispatcher, "resumed") == 1


async def test_the_hand_over_waits_for_a_known_worker_and_goes_on_there_when_it_is_healthy_again():
    servers, pool, _index, dispatcher = await start_dispatch(CONFIG, 2)
    try:
        servers[1].draining = True
        await pool.poll_once()
        assert [w.worker_id for w in pool.routable()] == ["w0"]
        relay, task, chunks, _ = await _stream_cut_after_5(servers, pool, dispatcher, wait_s=30)
        await _held_until_back_then_whole(servers[1], pool, dispatcher, relay, task, chunks)
    finally:
        await stop_dispatch(servers, pool)


async def test_a_known_worker_that_stays_unhealthy_ends_the_stream_after_the_wait():
    servers, pool, _index, dispatcher = await start_dispatch(CONFIG, 2)
    try:
        servers[1].draining = True
        await pool.poll_once()
        relay, task, chunks, cut_at = await _stream_cut_after_5(servers, pool, dispatcher, wait_s=1.5)
        await asyncio.wait_for(task, 10)
        waited = time.monotonic() - cut_at
        relay.close()
        assert chunks[-1].finish_reason == "error" and "no other worker could continue it" in chunks[-1].error
        assert 1.5 <= waited < 5, waited
        assert _migrations(dispatcher, "failed") == 1 and _migrations(dispatcher, "resumed") == 0
    finally:
        await stop_dispatch(servers, pool)


async def test_with_one_worker_the_stream_waits_for_it_to_come_back_and_goes_on_there():
    servers, pool, _index, dispatcher = await start_dispatch(CONFIG, 1)
    try:
        async def restarting():  # the worker's next poll finds it unhealthy, as while it restarts
            servers[0].draining = True
            await pool.poll_once()

        relay, task, chunks, _ = await _stream_cut_after_5(servers, pool, dispatcher, wait_s=30,
                                                           before_cut=restarting)
        await _held_until_back_then_whole(servers[0], pool, dispatcher, relay, task, chunks)
    finally:
        await stop_dispatch(servers, pool)


async def test_a_worker_takes_a_stream_back_only_once():
    servers, pool, _index, dispatcher = await start_dispatch(CONFIG, 1)
    try:
        relay, task, chunks, _ = await _stream_cut_after_5(servers, pool, dispatcher, wait_s=30)
        await until(lambda: relay.migrations == 1 and sum(len(c.token_ids) for c in chunks) >= 10,
                    what="the stream back on w0, 10 tokens in")
        _cut(servers[0])  # the same worker fails it again (a request that brings its worker down, say)
        cut_at = time.monotonic()
        await asyncio.wait_for(task, 10)
        waited = time.monotonic() - cut_at
        relay.close()
        assert chunks[-1].finish_reason == "error" and "no other worker could continue it" in chunks[-1].error
        assert waited < 2, waited  # nothing left to wait for: no third try on w0
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == [1000 + i for i in range(len(tokens))] and len(tokens) < TOKENS  # once each, in order
        assert _migrations(dispatcher, "resumed") == 1 and _migrations(dispatcher, "failed") == 1
    finally:
        await stop_dispatch(servers, pool)
