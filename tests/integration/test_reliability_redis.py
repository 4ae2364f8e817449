"""Redis stopped and restarted, and Redis frozen (SIGSTOP), under load on a real `pulse serve --redis-url`
(real redis-server, real Ray, two load-test workers; the prefix index, the key store and the quotas live in
Redis). Redis is not on the serving path's critical list: while it is gone requests go on being served
(routing falls back to load alone, keys to the open single-box default), and when it is back the workers'
KV block events fill the index again. What the clients saw per phase and the time until the index was
filled again are recorded.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp
import pytest
import redis.asyncio as aioredis

from bench.faults import chat_body, health, record, settled_idle, stream_chat
from bench.loadgen import percentiles
from tests.conftest import PulseProcess
from tests.conftest_redis import redis_module  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

CLIENTS = 16
PHASE_S = 4.0
CONFIG = """
model: {name: gemma-3-270m}  # one model (a config naming none serves both bundled ones)
workers:
  backend: loadtest
  count: 2
  loadtest: {tokens: 100000, tokens_per_s: 400}
server:
  drain_grace_s: 2
"""


@pytest.fixture(scope="module")
def redis_pulse(redis_module, tmp_path_factory):
    srv = PulseProcess(["--redis-url", redis_module.url], CONFIG, tmp_path_factory.mktemp("pulse-redis")).wait_ready()
    yield srv
    srv.stop()


async def index_keys(url: str) -> int:
    """Keys Pulse keeps in Redis (namespace 'pulse:'); -1 when Redis does not answer."""
    client = aioredis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return len([k async for k in client.scan_iter(match="pulse:*", count=1000)])
    except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
        return -1
    finally:
        await client.aclose()


class PhasedLoad:
    """CLIENTS closed-loop clients, each request tagged with the phase it started in."""

    def __init__(self, base: str):
        self.base, self.phase, self.running = base, "before", True
        self.seen: list[tuple[str, object]] = []

    async def client(self, session, i: int) -> None:
        n = 0
        while self.running:
            n += 1
            phase = self.phase
            # a few distinct prompts, repeated: the prefix index has something to route by
            body = chat_body(8, content=f"client {i % 4} asks the same long question again {n % 3}")
            self.seen.append((phase, await stream_chat(session, self.base, body, timeout_s=30)))

    def summary(self) -> dict:
        out = {}
        for phase in dict.fromkeys(p for p, _ in self.seen):
            runs = [s for p, s in self.seen if p == phase]
            ok = [s for s in runs if s.status == 200 and s.done and not s.error_events]
            kinds = Counter("200" if s in ok else f"{s.status} {s.exception or ''}{_code(s)}".strip() for s in runs)
            out[phase] = {"requests": len(runs), "answers": dict(kinds),
                          "latency_ms": {k: round(v, 1) for k, v in percentiles([s.seconds for s in ok]).items()
                                         if v is not None}}
        return out


def _code(seen) -> str:
    return seen.error_events[0]["error"].get("code", "") if seen.error_events else ""


async def run_fault(base: str, url: str, fault, repair) -> tuple[dict, float | None, list[int]]:
    load = PhasedLoad(base)
    health_seen: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.create_task(load.client(s, i)) for i in range(CLIENTS)]
        await asyncio.sleep(PHASE_S)
        assert await index_keys(url) > 0, "the index is empty before the fault: nothing published to Redis"
        load.phase = "redis_down"
        fault()
        for _ in range(int(PHASE_S / 0.5)):
            health_seen.append(await health(s, base))
            await asyncio.sleep(0.5)
        load.phase = "after"
        repaired = time.monotonic()
        repair()
        refilled = None
        while time.monotonic() - repaired < 30:
            if await index_keys(url) > 0:
                refilled = time.monotonic() - repaired
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, PHASE_S - (time.monotonic() - repaired)))
        load.running = False
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert await settled_idle(s, base) is not None, "a slot stayed held"
    return load.summary(), refilled, health_seen


def check(phases: dict, health_seen: list[int]) -> None:
    for phase, fig in phases.items():
        assert fig["requests"] > 0, phases
        # nothing accepted and lost, no stream cut, no hang: every request served in full
        assert fig["answers"] == {"200": fig["requests"]}, (phase, phases)
    assert set(health_seen) == {200}, health_seen


async def test_redis_stopped_and_restarted(redis_pulse, redis_module):
    phases, refilled, health_seen = await run_fault(redis_pulse.base, redis_module.url, redis_module.stop, redis_module.start)
    record("redis_stop_restart", {"clients": CLIENTS, "phase_s": PHASE_S, "phases": phases,
                                  "health_while_down": sorted(set(health_seen)),
                                  "seconds_until_index_refilled": None if refilled is None else round(refilled, 2)})
    check(phases, health_seen)
    assert refilled is not None, "the index stayed empty after Redis came back"


async def test_redis_frozen_and_resumed(redis_pulse, redis_module):
    phases, refilled, health_seen = await run_fault(redis_pulse.base, redis_module.url, redis_module.pause,
                                                    redis_module.resume)
    record("redis_freeze_resume", {"clients": CLIENTS, "phase_s": PHASE_S, "phases": phases,
                                   "health_while_frozen": sorted(set(health_seen)),
                                   "seconds_until_index_answers": None if refilled is None else round(refilled, 2)})
    check(phases, health_seen)
    # a frozen Redis costs each request at most about redis.timeout_s (50 ms) before the guard fails fast
    assert phases["redis_down"]["latency_ms"]["p50"] < phases["before"]["latency_ms"]["p50"] + 200, phases
