"""Two gateway replicas on one port (`server.gateway_replicas: 2`, no Redis), two engine workers on the CPU.

A conversation's turns may reach different replicas (the kernel spreads connections over the replicas'
shared port); each replica keeps its own prefix index. The next turn must still reach the worker that
holds the conversation and be served from its cache, and one scrape of /metrics counts both replicas.
"""
from __future__ import annotations

import aiohttp
import pytest

from tests.conftest import PulseProcess

SYSTEM = ("You are a careful coding agent working in a large Python repository. Follow the house style: "
          "small functions, type hints, docstrings that say why, tests for every change, and no global state. ") * 4

CONFIG = """
server: {gateway_replicas: 2}
model: {name: gemma-3-270m}
workers:
  backend: cupy
  count: 2
  engine: {max_num_seqs: 2, kv_blocks: 512}
"""


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    srv = PulseProcess([], CONFIG, tmp_path_factory.mktemp("replicas")).wait_ready(300)
    yield srv
    srv.stop()


async def on_replica(base: str, avoid: str | None = None, want: str | None = None,
                     tries: int = 64) -> tuple[aiohttp.ClientSession, str]:
    """A client session whose one kept-alive connection reached replica `want`, or any but `avoid`."""
    for _ in range(tries):
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with s.get(base + "/health") as r:
            assert r.status == 200
            replica = r.headers["x-pulse-gateway"]
        if replica != avoid and want in (None, replica):
            return s, replica
        await s.close()  # the next connection comes from another port, which the kernel may hash elsewhere
    raise AssertionError(f"no connection reached the replica asked for (avoid {avoid}, want {want})")


SERVED = []  # one entry per 200 this module got


async def turn(s: aiohttp.ClientSession, base: str, session: str, messages: list[dict],
               max_tokens: int = 4) -> tuple[str, str, dict]:
    body = {"model": "gemma-3-270m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    async with s.post(base + "/v1/chat/completions", json=body, headers={"x-session-id": session}) as r:
        data = await r.json()
        assert r.status == 200, data
        SERVED.append(r.headers["x-pulse-gateway"])
        return r.headers["x-pulse-gateway"], r.headers["x-pulse-worker"], data


async def test_next_turn_on_the_other_replica_keeps_its_worker_and_cache(two_replicas):
    """Two conversations start on replica A, which spreads them over the two workers; their next turns go to
    replica B in the opposite order. B never saw them: had it no view of where their blocks are, spreading
    them by its own counts would send each to the other worker."""
    base, topics, firsts = two_replicas.base, ("parsers", "schedulers"), {}
    replica_a = None
    for topic in topics:
        # the topic leads, so the two conversations share no prefix: only one worker holds each
        messages = [{"role": "system", "content": f"This session is about {topic}. " + SYSTEM},
                    {"role": "user", "content": f"Refactor the {topic}."}]
        s, replica_a = await on_replica(base, want=replica_a)
        async with s:
            # one token: the turn ends right after its prompt's blocks are made, long before the next index poll
            firsts[topic] = (messages, *(await turn(s, base, topic, messages, max_tokens=1))[1:])
    assert firsts["parsers"][1] != firsts["schedulers"][1], "replica A put both conversations on one worker"
    for topic in reversed(topics):
        messages, worker, first = firsts[topic]
        second = messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "Now add tests."}]
        s, replica_b = await on_replica(base, avoid=replica_a)
        async with s:
            got, w2, d2 = await turn(s, base, topic, second)  # at once: no wait for the next index poll
        assert got == replica_b != replica_a
        assert w2 == worker, (topic, worker, w2)
        cached = d2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 32, (cached, first["usage"])


async def test_one_scrape_counts_both_replicas(two_replicas):
    base = two_replicas.base

    def served(text: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pulse_requests_total{") and 'status="200"' in line)

    replica = None
    for _ in range(2):
        s, replica = await on_replica(base, avoid=replica)
        async with s:
            await turn(s, base, f"count-{replica}", [{"role": "user", "content": "hi"}])
            async with s.get(base + "/metrics") as r:
                assert r.headers["x-pulse-gateway"] == replica
                assert served(await r.text()) == len(SERVED)  # every replica's requests, not only this one's
    assert len(set(SERVED)) == 2
