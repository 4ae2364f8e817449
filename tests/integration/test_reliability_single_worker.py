"""Faults against a real `pulse serve` with one worker streaming as fast as it can (load-test backend).

- Clients that stop reading (headers read, then silence) while the server could stream a million tokens:
  backpressure reaches the worker (its generation stalls), the gateway's memory stays bounded, other
  clients are served as usual, and when the slow clients leave their generations are cancelled.
- The only worker killed mid-stream: while it is down /health is 503 and new requests get OpenAI-shaped 503s
  with Retry-After (not hangs); Ray restarts it, requests succeed again, and the stream it was serving waits for
  it and goes on there (gateway/migration.py): every token once, in order, then [DONE]. Time to healthy is
  recorded.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time

import aiohttp
import msgspec
import pytest

from bench.faults import (
    chat_body,
    health,
    listening_pids,
    port_of,
    record,
    rss_bytes,
    tcp_kernel_bytes,
    settled_idle,
    stream_chat,
    wait_until,
    workers,
)
from tests.conftest import PulseProcess
from workers.protocol import Chunk

pytestmark = pytest.mark.slow

# tokens_per_s 0: as fast as the worker can; a context of 2M tokens lets one request ask for a million
CONFIG = """
model:
  context_length: 2000000
workers:
  backend: loadtest
  loadtest: {tokens: 1000000, tokens_per_s: 0}
server:
  drain_grace_s: 2
"""
SLOW_CLIENTS = 8
RSS_BOUND = 32 * 1024 * 1024  # below what the stalled streams would have buffered (see the last assertion)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    srv = PulseProcess([], CONFIG, tmp_path_factory.mktemp("pulse-single")).wait_ready()
    yield srv
    srv.stop()


def silent_client(port: int) -> socket.socket:
    """Send a streaming request, read the response headers, then stop reading (a tiny receive window)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(chat_body(1_000_000)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    sock.settimeout(30)
    head = sock.recv(1024)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return sock


def chunk_bytes() -> int:
    """Memory of one token's chunk as the gateway's relay decodes it from the worker's line (the load-test
    backend's chunk: a short text and one token id)."""
    c = msgspec.json.decode(b'{"text":" t123456","token_ids":[1123456]}', type=Chunk)
    return sys.getsizeof(c) + sys.getsizeof(c.text) + sys.getsizeof(c.token_ids) + sys.getsizeof(c.token_ids[0])


async def generated(session, base: str) -> int:
    return sum(w["stats"]["generated_tokens"] for w in await workers(session, base))


async def stalled(session, base: str, quiet_s: float = 2.0, timeout_s: float = 60.0) -> float | None:
    """Seconds until the workers' generated-token count stopped moving for quiet_s (None: it never did)."""
    t0 = time.monotonic()
    last, since = await generated(session, base), time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.6)  # the gateway polls worker stats every 0.5 s
        now = await generated(session, base)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return since - t0
    return None


async def test_slow_reader_memory_bounded_and_cancelled(one_worker):
    base, port = one_worker.base, one_worker.port
    (gateway_pid,) = listening_pids(port)
    async with aiohttp.ClientSession() as s:
        rss0, gen0, tcp0 = rss_bytes(gateway_pid), await generated(s, base), tcp_kernel_bytes()
        socks = [silent_client(port) for _ in range(SLOW_CLIENTS)]
        try:
            stall_s = await stalled(s, base)
            assert stall_s is not None, "generation never stalled: nothing pushes back on the worker"
            stuck_tokens = await generated(s, base) - gen0
            await asyncio.sleep(3)  # hold the stall a while: memory must not creep
            rss_stalled, tcp_stalled = rss_bytes(gateway_pid), tcp_kernel_bytes()
            assert await generated(s, base) - gen0 == stuck_tokens, "generation resumed with nobody reading"
            rows = await workers(s, base)
            assert rows[0]["stats"]["running"] == SLOW_CLIENTS
            t0 = time.monotonic()  # another client is served as usual meanwhile
            other = await stream_chat(s, base, chat_body(200), timeout_s=30)
            other_s = time.monotonic() - t0
        finally:
            for sock in socks:
                sock.close()
        to_idle = await settled_idle(s, base, timeout_s=10)
    growth = rss_stalled - rss0
    # 200 tokens, in as many events as the gateway framed (chunks that reach it together share one)
    assert other.status == 200 and other.done and other.text.split() == [f"t{i}" for i in range(200)], other
    assert other_s < 5, f"a normal client took {other_s:.1f} s next to the slow ones"
    assert growth < RSS_BOUND, f"gateway RSS grew {growth / 2**20:.1f} MiB with {SLOW_CLIENTS} slow readers"
    # what the gateway would hold had it kept reading the stalled streams into its own memory: the worker's
    # chunks, decoded as its relay holds them (the SSE bytes a client receives per token depend on how many
    # tokens share an event, so they no longer measure this)
    would_buffer = stuck_tokens * chunk_bytes()
    assert would_buffer > 1.5 * RSS_BOUND, f"only {would_buffer / 2**20:.0f} MiB generated: the bound means nothing"
    assert to_idle is not None, "the slow clients' generations were not cancelled when they left"
    record("slow_reader", {
        "slow_clients": SLOW_CLIENTS, "tokens_generated_before_stall": stuck_tokens,
        "seconds_until_generation_stalled": round(stall_s, 2),
        "gateway_rss_before_mib": round(rss0 / 2**20, 1), "gateway_rss_stalled_mib": round(rss_stalled / 2**20, 1),
        "gateway_rss_growth_mib": round(growth / 2**20, 2),
        "unbuffered_equivalent_mib": round(would_buffer / 2**20, 1),
        # where the stalled stream sits instead: kernel socket buffers (box-wide reading, so approximate)
        "kernel_tcp_buffers_growth_mib": round((tcp_stalled - tcp0) / 2**20, 1),
        "other_client_200_tokens_s": round(other_s, 3),
        "seconds_until_cancelled_after_leave": round(to_idle, 2),
    })


async def test_kill_the_only_worker(one_worker):
    base = one_worker.base
    outage: list[tuple[float, int, int, str | None, str | None]] = []
    tokens = 20_000
    async with aiohttp.ClientSession() as s:
        rows = await workers(s, base)
        (pid,) = listening_pids(port_of(rows[0]["url"]))
        killed: dict = {}

        async def kill_at_20(seen) -> None:
            if seen.content_events == 20 and not killed:
                os.kill(pid, signal.SIGKILL)
                killed["t"] = time.monotonic()

        body = dict(chat_body(tokens), stream_options={"include_usage": True})
        cut_task = asyncio.create_task(stream_chat(s, base, body, on_event=kill_at_20, timeout_s=90))

        async def was_killed() -> bool:
            return bool(killed) or cut_task.done()

        assert await wait_until(was_killed, 30) is not None and killed, "the stream ended before it could be cut"

        async def served() -> bool:
            h = await health(s, base)
            seen = await stream_chat(s, base, chat_body(5), timeout_s=15)
            err = seen.error_events[0]["error"] if seen.error_events else {}
            outage.append((round(time.monotonic() - killed["t"], 2), h, seen.status, err.get("code"),
                           seen.retry_after))
            return h == 200 and seen.status == 200 and seen.done

        to_healthy = await wait_until(served, 60, 0.1)
        cut = await cut_task
        (new_pid,) = listening_pids(port_of((await workers(s, base))[0]["url"]))
        idle = await settled_idle(s, base)
    # the stream waited for the restarted worker and went on there: one whole stream, no error event
    whole = "".join(f" t{i}" for i in range(tokens))  # the load-test backend's text
    assert cut.complete and cut.exception is None and cut.text == whole, (cut.error_events, cut.text[-80:])
    assert cut.finish_reason == "length" and cut.usage["completion_tokens"] == tokens, cut.usage
    assert to_healthy is not None, f"not healthy within 60 s of the kill: {outage[-3:]}"
    assert new_pid != pid
    failed = [o for o in outage[:-1]]
    # during the outage every answer is an explicit 503 with Retry-After, never a hang or a 5xx of another kind
    assert all(status == 503 and code in ("no_healthy_worker", "workers_unavailable") and retry
               for _, _, status, code, retry in failed), failed
    assert idle is not None
    record("kill_only_worker", {
        "workers": 1, "stream_saw": f"all {tokens} tokens in order and [DONE] (went on on the restarted worker)",
        "stream_ended_s_after_kill": round(cut.ended - killed["t"], 3),
        "requests_during_outage": len(failed), "their_answers": sorted({f"{o[2]} {o[3]}" for o in failed}),
        "health_during_outage": sorted({o[1] for o in failed}),
        "seconds_until_healthy_and_serving": round(to_healthy, 2),
    })
