"""Two gateway replicas in front of one worker serve its place in one order (policy.admission.gateway_order).

A real `pulse serve` with `server.gateway_replicas: 2` and the load-test backend with one place (no queue at the
worker), each request ~2 s, admission's order as it ships (a margin of 1 s). Replica A's request holds the place; a
request to replica B waits in B's queue; later a second request reaches A. When A's request ends, A hears of it at
once and B only at its next stats poll, so without one order across the replicas A's newer request took the place
(in most runs; B's poll sometimes came first) and B's, which had waited longer, waited a whole generation more (the
TTFT tail of 32-64 clients over 2-4 replicas in front of llama-server, BENCHMARKS.md).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import PulseProcess
from tests.integration.test_gateway_replicas import on_replica
from tests.integration.test_replica_shares import both_up

CONFIG = """
server: {gateway_replicas: 2}
workers:
  backend: loadtest
  loadtest: {tokens: 50, tokens_per_s: 25, slots: 1}
admission: {worker_queue_max: 0}
"""


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    srv = PulseProcess([], CONFIG, tmp_path_factory.mktemp("order")).wait_ready()
    yield srv
    srv.stop()


async def test_a_request_that_waited_on_one_replica_goes_before_a_newer_one_on_the_other(replicas):
    base = replicas.base
    await both_up(base)
    a1, first = await on_replica(base)
    a2, _ = await on_replica(base, want=first)
    b, _ = await on_replica(base, avoid=first)
    async with a1.get(base + "/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    done: dict[str, float] = {}
    t0 = time.monotonic()

    async def one(s, name: str, after_s: float) -> None:
        await asyncio.sleep(max(0.0, t0 + after_s - time.monotonic()))
        body = {"model": model, "prompt": "hi", "max_tokens": 50}
        async with s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
        done[name] = time.monotonic() - t0

    try:
        # A's first holds the place ~2 s; B's waits from 0.1 s; A's second from 1.5 s, 1.4 s after B's (the
        # order's margin is 1 s); when A's first ends, B's goes next
        await asyncio.wait_for(asyncio.gather(one(a1, "a1", 0.0), one(b, "b", 0.1), one(a2, "a2", 1.5)), 30.0)
    finally:
        for s in (a1, a2, b):
            await s.close()
    assert done["a1"] < done["b"] < done["a2"], done
