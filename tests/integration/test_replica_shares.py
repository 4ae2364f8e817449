"""Two gateway replicas in front of one worker share its places by demand (policy.admission.over_share).

A real `pulse serve` with `server.gateway_replicas: 2` and the load-test backend (2 places, ~0.16 s a request,
no queue at the worker). Eight clients on one replica send requests back to back, so that replica always has a
queue; then four clients on the other replica send two requests each. Each replica refills the places its own
requests free at once and sees the other's only through the worker's stats, so before the replicas told each
other their queues (through the worker's stats polls) the first replica kept both places for as long as its
flood lasted and the second one's requests waited for all of it.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.conftest import PulseProcess
from tests.integration.test_gateway_replicas import on_replica

CONFIG = """
server: {gateway_replicas: 2}
workers:
  backend: loadtest
  loadtest: {tokens: 5, tokens_per_s: 25, slots: 2}
admission: {worker_queue_max: 0}
"""
FLOOD, LATE, LATE_EACH = 8, 4, 2
BOUND_S = 20.0  # the late clients' whole run, at most: without the shares they wait for the flood to stop


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    srv = PulseProcess([], CONFIG, tmp_path_factory.mktemp("shares")).wait_ready()
    yield srv
    srv.stop()


async def both_up(base: str, timeout_s: float = 60.0) -> None:
    """/health answers once one replica is up; the other may still be starting."""
    seen, deadline = set(), time.monotonic() + timeout_s
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only replica {seen} answered"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(base + "/health") as r:
                seen.add(r.headers["x-pulse-gateway"])
        await asyncio.sleep(0.05)


async def test_a_flood_on_one_replica_does_not_keep_the_other_replicas_requests_waiting(replicas):
    base = replicas.base
    await both_up(base)
    first, flooded = await on_replica(base)
    flood_sessions = [first] + [(await on_replica(base, want=flooded))[0] for _ in range(FLOOD - 1)]
    late_sessions = [(await on_replica(base, avoid=flooded))[0] for _ in range(LATE)]
    async with flood_sessions[0].get(base + "/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    stop = asyncio.Event()
    served = {"flood": 0, "late": 0}

    async def one(s: aiohttp.ClientSession, who: str) -> None:
        body = {"model": model, "prompt": "hi", "max_tokens": 5}
        async with s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
        served[who] += 1

    async def flood(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            await one(s, "flood")

    async def late(s: aiohttp.ClientSession) -> list[float]:
        waits = []
        for _ in range(LATE_EACH):
            t0 = time.monotonic()
            await one(s, "late")
            waits.append(time.monotonic() - t0)
        return waits

    try:
        flooding = [asyncio.create_task(flood(s)) for s in flood_sessions]
        await asyncio.sleep(1.5)  # the flood holds both places and keeps a queue on its replica
        before = served["flood"]
        t0 = time.monotonic()
        waits = await asyncio.wait_for(asyncio.gather(*(late(s) for s in late_sessions)), BOUND_S)
        took = time.monotonic() - t0
        assert served["flood"] > before  # the flood went on while the late requests were served
        stop.set()
        await asyncio.gather(*flooding)
    finally:
        stop.set()
        for s in flood_sessions + late_sessions:
            await s.close()
    # 8 late requests on about one place: ~1.3 s of work, plus a stats poll or two (0.5 s) for each replica to
    # hear the other's queue (2.7 s in all, the longest request 2.1 s, with the CI suite beside it on 2 cores); the
    # flood alone would have kept them waiting for all of BOUND_S (they got 429s after three refusals)
    assert served["late"] == LATE * LATE_EACH
    assert took < 6.0, (took, waits)
    assert max(w for ws in waits for w in ws) < 4.0, waits
