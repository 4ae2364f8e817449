"""A worker's HTTP channel answers only its gateway and checks every bound itself.

A real StreamServer (the load-test backend behind it) on loopback: requests without the channel secret,
or with a wrong one, get 401 on every route; the gateway's pool (which has the secret from WorkerInfo)
streams; out-of-bounds GenerateRequests get 400 from the worker even though no gateway checked them.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec
import pytest

from gateway.pool import WorkerPool, iter_batches
from policy.config import PulseConfig
from workers.loadtest import LoadTestBackend
from workers.protocol import GenerateRequest, WorkerInfo, encode
from workers.request_limits import RequestLimits
from workers.stream import GATEWAY_REPORT_TTL_S, StreamServer

LIMITS = RequestLimits(context_length=4096, vocab_size=1000, max_stop_strings=4, max_stop_length=32)


@pytest.fixture
async def worker():
    config = PulseConfig.model_validate({"workers": {"backend": "loadtest", "loadtest": {"tokens": 4}}})
    srv = StreamServer(LoadTestBackend(config, worker_id="w0"), worker_id="w0", limits=LIMITS)
    url = await srv.start()
    async with aiohttp.ClientSession() as http:
        yield srv, url, http
    await srv.close()


def _gen(**kw) -> dict:
    return msgspec.to_builtins(GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], max_tokens=4, **kw))


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}])
@pytest.mark.parametrize("method,path", [("POST", "/generate"), ("GET", "/stats"), ("GET", "/blocks")])
async def test_no_secret_no_answer(worker, headers, method, path):
    srv, url, http = worker
    async with http.request(method, url + path, json=_gen(), headers=headers) as r:
        assert r.status == 401
        assert (await r.json())["error"]["code"] == "unauthorized"


async def test_the_pool_streams_with_the_secret_from_worker_info(worker):
    srv, url, _ = worker
    info = WorkerInfo("w0", url, "loadtest", secret=srv.secret)

    async def discover(worker_id):
        return [info]

    pool = WorkerPool(discover, poll_interval_s=30)
    await pool.start()
    try:
        w = pool.workers["w0"]
        assert w.healthy  # its /stats poll was authorized
        resp = await pool.open_stream(w, GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], max_tokens=4))
        chunks = [c async for batch in iter_batches(resp) for c in batch]
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 4
    finally:
        await pool.close()


@pytest.mark.parametrize("fields,reason", [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": ["a"] * 5}, "stop has 5"),
    ({"stop": ["x" * 33]}, "stop string"),
    ({"stop": [""]}, "stop string"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"prompt_ids": []}, "prompt_ids"),
    ({"prompt_ids": [5000]}, "prompt_ids holds"),
    ({"prompt_ids": [-1]}, "prompt_ids holds"),
    ({"prompt_ids": [1] * 4096}, "prompt_ids"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4094}, "max_tokens"),
    ({"prediction_ids": [1] * 4097}, "prediction_ids"),
    ({"prediction_ids": [1000]}, "prediction_ids holds"),
    ({"grammar": "x" * (256 * 1024 + 1)}, "grammar"),
    ({"max_draft_tokens": -1}, "max_draft_tokens"),
    ({"sampling": {"temperature": 3.0}}, "sampling.temperature"),
    ({"sampling": {"top_p": 0.0}}, "sampling.top_p"),
    ({"sampling": {"min_p": 1.5}}, "sampling.min_p"),
    ({"sampling": {"frequency_penalty": -2.5}}, "sampling.frequency_penalty"),
    ({"sampling": {"presence_penalty": 1e9}}, "sampling.presence_penalty"),
    ({"sampling": {"top_k": -1}}, "sampling.top_k"),
])
async def test_worker_refuses_out_of_bounds(worker, fields, reason):
    srv, url, http = worker
    body = {**_gen(), **fields}
    async with http.post(url + "/generate", data=encode(body), headers={"Authorization": f"Bearer {srv.secret}"}) as r:
        assert r.status == 400, await r.text()
        assert reason in (await r.json())["error"]["message"]


async def test_body_limit_far_below_64_mib(worker):
    srv, url, http = worker
    assert LIMITS.max_body_bytes < 4 << 20
    assert RequestLimits(context_length=131072).max_body_bytes < 8 << 20
    body = b'{"request_id": "' + b"x" * (LIMITS.max_body_bytes + 1) + b'"}'
    async with http.post(url + "/generate", data=body, headers={"Authorization": f"Bearer {srv.secret}"}) as r:
        assert r.status == 413


async def test_within_bounds_streams(worker):
    srv, url, http = worker
    body = _gen(logprobs=20, stop=["abcd"] * 4, prediction_ids=[7] * 10)
    async with http.post(url + "/generate", data=encode(body), headers={"Authorization": f"Bearer {srv.secret}"}) as r:
        assert r.status == 200
        lines = [line for line in (await r.read()).split(b"\n") if line]
        assert b'"finish_reason"' in lines[-1]


async def test_the_final_line_and_the_chunked_terminator_leave_in_one_write(worker):
    """A gateway stops reading at the final line; the terminator already beside it lets it keep the connection
    (gateway/channel.py). A blocking reader in a thread wakes on the first bytes that arrive, so a terminator
    written apart (as before) is not yet in its buffer when the final line is."""
    import asyncio
    import json
    import socket
    from urllib.parse import urlsplit

    srv, url, _ = worker
    host, port = urlsplit(url).hostname, urlsplit(url).port
    body = json.dumps(_gen()).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {srv.secret}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()

    def read_to_final_line() -> bytes:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(head + body)
            got = b""
            while b'"finish_reason"' not in got:
                data = s.recv(65536)
                assert data, got
                got += data
            return got

    for _ in range(5):
        got = await asyncio.to_thread(read_to_final_line)
        assert got.endswith(b"\r\n0\r\n\r\n"), got[-120:]


async def test_gateways_hear_each_others_queues_through_the_worker(worker):
    """Two gateways' pools poll one worker, each saying how many requests wait in its admission queue; each
    hears the other's (not its own) in `gateways_waiting`, which admission's share of the places reads, and how
    many others there are in `other_gateways` (admission pools the queue with them). A gateway that stops polling
    is forgotten; a bad count is a 400, not a crash."""
    srv, url, http = worker
    info = WorkerInfo("w0", url, "loadtest", secret=srv.secret)

    async def discover(worker_id):
        return [info]

    a, b = WorkerPool(discover, poll_interval_s=30), WorkerPool(discover, poll_interval_s=30)
    a.queue_depth, b.queue_depth = (lambda: 7), (lambda: 3)
    await a.start()
    await b.start()
    try:
        await a.poll_once()  # a's first poll came before b had said anything
        assert a.workers["w0"].stats.gateways_waiting == 3 and b.workers["w0"].stats.gateways_waiting == 7
        assert a.workers["w0"].stats.other_gateways == 1 and b.workers["w0"].stats.other_gateways == 1
        a.queue_depth = lambda: 0
        await a.poll_once()
        await b.poll_once()
        assert b.workers["w0"].stats.gateways_waiting == 0
        auth = {"Authorization": f"Bearer {srv.secret}"}
        async with http.get(url + "/stats", headers=auth) as r:  # anyone else (the status page): everyone's
            body = await r.json()
            assert body["gateways_waiting"] == 3 and body["other_gateways"] == 2
        async with http.get(url + "/stats?gateway=x&waiting=many", headers=auth) as r:
            assert r.status == 400
        srv._gateways.expire(time.monotonic() + GATEWAY_REPORT_TTL_S)  # as if no gateway had polled since
        async with http.get(url + "/stats", headers=auth) as r:
            body = await r.json()
            assert body.get("gateways_waiting", 0) == 0 and body.get("other_gateways", 0) == 0
    finally:
        await a.close()
        await b.close()


async def test_gateways_hear_the_head_that_goes_first_among_the_others_queues(worker):
    """Each gateway tells the worker its queue's head for it (priority and wait) and hears the others' head that
    goes first across them (the highest priority, then the one that waited longest), with its wait as of the
    answer: the replicas serve the worker's places in one order (policy.admission.gateway_order). A malformed head
    is a 400."""
    srv, url, http = worker
    info = WorkerInfo("w0", url, "loadtest", secret=srv.secret)

    async def discover(worker_id):
        return [info]

    pools = [WorkerPool(discover, poll_interval_s=30) for _ in range(3)]
    a, b, c = pools
    a.queue_heads = lambda: {"w0": (0, 2.0)}
    b.queue_heads = lambda: {"w0": (0, 0.5), "elsewhere": (5, 9.0)}  # its head for another worker is not this one's
    for p in pools:
        await p.start()
    try:
        await a.poll_once()
        await b.poll_once()
        await c.poll_once()
        got = c.workers["w0"].stats
        assert got.gateways_head_priority == 0 and 2.0 <= got.gateways_head_waited_s < 5.0, got
        got = a.workers["w0"].stats  # a's own head is not news to a: b's is
        assert got.gateways_head_priority == 0 and 0.5 <= got.gateways_head_waited_s < 2.0, got
        b.queue_heads = lambda: {"w0": (1, 0.0)}  # a higher priority goes first, however new
        await b.poll_once()
        await c.poll_once()
        assert c.workers["w0"].stats.gateways_head_priority == 1
        b.queue_heads = a.queue_heads = dict  # their queues emptied: no head waits for it
        await a.poll_once()
        await b.poll_once()
        await c.poll_once()
        assert c.workers["w0"].stats.gateways_head_priority is None
        auth = {"Authorization": f"Bearer {srv.secret}"}
        for bad in ("1", "x:5", "1:2:3"):
            async with http.get(url + f"/stats?gateway=x&waiting=1&head={bad}", headers=auth) as r:
                assert r.status == 400, bad
    finally:
        for p in pools:
            await p.close()


async def test_a_gateway_polls_fast_while_requests_wait_anywhere(worker):
    """While requests wait in an admission queue, this gateway's or another's (as the worker tells it), the stats
    poll runs at busy_poll_s, so a place another replica's request freed, or one a replica over its share left free,
    is seen within that time; with nothing waiting anywhere the poll keeps its plain interval."""
    srv, url, http = worker
    info = WorkerInfo("w0", url, "loadtest", secret=srv.secret)

    async def discover(worker_id):
        return [info]

    a = WorkerPool(discover, poll_interval_s=30, busy_poll_s=0.05)
    b = WorkerPool(discover, poll_interval_s=30, busy_poll_s=0.05)
    waiting = 4
    b.queue_depth = lambda: waiting
    await b.start()  # b polls first: the worker knows b's queue before a's first poll
    await a.start()
    try:
        assert b.poll_delay() == 0.05  # its own queue
        assert a.workers["w0"].stats.gateways_waiting == 4 and a.poll_delay() == 0.05  # b's, through the worker
        seen = a.workers["w0"].last_seen
        await asyncio.sleep(0.5)
        assert a.workers["w0"].last_seen > seen  # its loop polled again well before 30 s
        waiting = 0
        await b.poll_once()
        await a.poll_once()
        assert a.poll_delay() == 30 and b.poll_delay() == 30
        await asyncio.sleep(0.15)  # the poll each loop had already set for 0.05 s
        seen = a.workers["w0"].last_seen
        await asyncio.sleep(0.3)
        assert a.workers["w0"].last_seen == seen  # idle: no poll before the plain interval
        a.workers["w0"].refused = True  # the worker said no since the last poll: find out soon when it has room
        assert a.poll_delay() == 0.05
        a.workers["w0"].refused = False
        waiting = 4
        b.queue_needs_stats = lambda: False  # b's queue waits only for places its own requests hold
        await b.poll_once()
        await a.poll_once()
        assert b.poll_delay() == 30  # their ends wake it: no need to ask the worker
        assert a.poll_delay() == 0.05  # a still hears of b's queue through the worker, and shares the places
    finally:
        await a.close()
        await b.close()
