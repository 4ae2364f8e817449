"""llama-server killed under a real `pulse serve --backend llama-server` (real Ray, real gateway, the real
binary and the bundled model): the client mid-stream gets one in-band SSE error event and the stream
closes; the worker actor survives and its supervisor starts a new llama-server; the gateway serves again.
Time to healthy is recorded. Skips where llama-server is not built (deploy/build_llama_server.sh).
"""
from __future__ import annotations

import os
import signal
import time

import aiohttp
import pytest

from bench.faults import chat_body, child_pids, health, listening_pids, port_of, record, settled_idle, stream_chat, wait_until, workers
from tests.conftest import PulseProcess
from tests.integration.llama_server_helpers import serve_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pulse-llama")
    config = serve_config(tmp, slots=2, kv_tokens=4096, threads=2,  # skips when llama-server is not built
                          more="server:\n  drain_grace_s: 2\n")
    srv = PulseProcess([], config, tmp).wait_ready(300)
    yield srv
    srv.stop()


async def test_kill_llama_server_mid_stream(llama_serve):
    base = llama_serve.base
    outage: list[tuple[float, int, int, str | None]] = []
    async with aiohttp.ClientSession() as s:
        (worker_pid,) = listening_pids(port_of((await workers(s, base))[0]["url"]))
        (victim,) = child_pids(worker_pid, "llama-server")
        killed: dict = {}

        async def kill_at_5(seen) -> None:
            if seen.content_events == 5 and not killed:
                os.kill(victim, signal.SIGKILL)
                killed["t"] = time.monotonic()

        body = dict(chat_body(400, content="Tell me a long story about the sea."), ignore_eos=True, temperature=0)
        cut = await stream_chat(s, base, body, on_event=kill_at_5, timeout_s=120)
        assert killed, f"the stream ended before it could be cut: {cut}"

        async def served() -> bool:
            h = await health(s, base)
            seen = await stream_chat(s, base, chat_body(4), timeout_s=60)
            err = seen.error_events[0]["error"] if seen.error_events else {}
            outage.append((round(time.monotonic() - killed["t"], 2), h, seen.status, err.get("code")))
            return h == 200 and seen.status == 200 and seen.done

        to_healthy = await wait_until(served, 120, 0.2)
        (new_worker_pid,) = listening_pids(port_of((await workers(s, base))[0]["url"]))
        new_llama = child_pids(new_worker_pid, "llama-server")
        idle = await settled_idle(s, base)
    assert len(cut.error_events) == 1 and cut.error_events[0]["error"]["code"] == "worker_failed", cut
    assert cut.closed and not cut.done and cut.ended - killed["t"] < 5, cut
    assert to_healthy is not None, f"not serving within 120 s of the kill: {outage[-3:]}"
    assert new_worker_pid == worker_pid, "the worker actor itself should have survived"
    assert len(new_llama) == 1 and new_llama[0] != victim
    # what the requests during the restart got: served (waited for the new process) or an explicit 503
    assert all(status in (200, 503) for _, _, status, _ in outage), outage
    assert idle is not None
    record("kill_llama_server", {
        "stream_saw": "1 SSE error event (worker_failed), then close",
        "stream_closed_within_s": round(cut.ended - killed["t"], 3),
        "requests_until_served": len(outage), "their_answers": sorted({f"{o[2]} {o[3]}" for o in outage}),
        "health_seen": sorted({o[1] for o in outage}),
        "seconds_until_serving": round(to_healthy, 2),
    })
