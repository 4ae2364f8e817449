"""The load generator spread over processes (LoadSpec.procs): each process its share of the clients and of the
run's request indices, all measured over one wall time; end to end against a loopback streaming server."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from bench import loadgen
from bench.loadgen import LoadSpec, RequestResult, _Share, _shares, run_load

pytestmark = pytest.mark.timeout(30)

HOLD_S = 0.15  # how long the test server takes to stream one answer
WORDS = ("a", "b", "c")


@pytest.mark.parametrize("clients, procs, requests", [(6, 3, 12), (7, 3, 17), (5, 2, 3), (1000, 8, 2001)])
def test_shares_split_the_clients_evenly_and_the_request_indices_without_overlap(clients, procs, requests):
    shares = _shares(clients, procs)
    counts = [s.count for s in shares]
    assert sum(counts) == clients and max(counts) - min(counts) <= 1
    assert [s.first for s in shares] == [sum(counts[:p]) for p in range(procs)]
    sent = [s.index(j) for s in shares for j in range(s.requests(requests))]
    assert sorted(sent) == list(range(requests))  # every index of the run once, in one process
    whole = _Share(0, clients, clients)
    assert whole.requests(requests) == requests and [whole.index(j) for j in range(50)] == list(range(50))
    assert all(s.requests(None) is None for s in shares)


async def test_a_share_starts_its_clients_at_their_place_in_the_whole_runs_stagger(monkeypatch):
    """Clients 2 and 3 of 6, stagger 0.6 s: they start 0.2 s and 0.3 s after the start, as in one process, and
    send the prompts of the run's requests 2 and 3 (each request held longer than the stagger, so each client
    sends one)."""
    starts, prompts = [], []

    async def held(session, url, body, stream):
        starts.append(time.perf_counter())
        prompts.append(body["prompt"])
        await asyncio.sleep(0.3)
        return RequestResult(status=200, ttft=0.01, total=0.3, tokens=1)

    monkeypatch.setattr(loadgen, "one_request", held)
    share = _Share(2, 2, 6)
    spec = LoadSpec(url="http://127.0.0.1:1", api="completions", clients=6, requests=share.requests(6), duration=10,
                    stagger_s=0.6, prompts=[f"p{i}" for i in range(12)])
    t0, results = time.perf_counter(), []
    await loadgen._closed_loop(spec, None, "u", {}, t0, results, share)
    assert len(results) == 2 and sorted(prompts) == ["p2", "p3"]
    for i, at in zip((2, 3), sorted(s - t0 for s in starts)):
        assert at == pytest.approx(i * 0.6 / 6, abs=0.05)


@pytest.fixture
async def server():
    """A streaming /v1/completions on loopback: three text events HOLD_S apart in all, then usage; `seen` records
    each request's prompt."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen = []

    async def completions(request):
        body = await request.json()
        seen.append(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in WORDS:
            await asyncio.sleep(HOLD_S / len(WORDS))
            await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": word}]}).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": len(WORDS)}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with TestServer(app, host="127.0.0.1") as srv:
        yield str(srv.make_url("/")), seen


@pytest.mark.parametrize("procs", [1, 3])
async def test_run_load_over_processes_sends_every_prompt_once_over_one_wall_time(server, procs):
    """12 requests of 6 clients, in this process or 2 clients in each of 3: every request served, each of the
    12 prompts sent once, every token counted, the processes' CPU summed; the wall time holds the two rounds of
    requests and not the processes' start-up."""
    url, seen = server
    prompts = [f"prompt {i}" for i in range(12)]
    spec = LoadSpec(url=url, api="completions", clients=6, requests=12, duration=5, timeout=5, prompts=prompts,
                    max_tokens=len(WORDS), procs=procs)
    t0 = time.perf_counter()
    out = await run_load(spec)
    elapsed = time.perf_counter() - t0
    m = out["metrics"]
    assert (m["requests"], m["ok"], m["errors"]) == (12, 12, 0), out
    assert sorted(seen) == sorted(prompts)
    assert m["tok_s"] * m["wall_s"] == pytest.approx(12 * len(WORDS))
    assert m["events_per_req"] == len(WORDS)
    assert m["client_cpu"] > 0
    assert 2 * HOLD_S <= m["wall_s"] <= min(elapsed, 2 * HOLD_S + 1.0)
