"""A real llama-server that crashes, hangs, or loses its worker: streams end in time, the process comes
back by itself, and no llama-server outlives the worker that started it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bench.procs import wait_gone
from tests.conftest import ROOT
from tests.integration.llama_server_helpers import (
    collect, encode, llama_server_binary, make_backend, pid_alive, request)
from tests.waiting import until
from workers.protocol import BackendError

PROMPT = "Tell me a long story about a lighthouse keeper, the sea, the storms and the ships he saved."


async def test_crash_mid_stream_ends_the_stream_and_the_process_comes_back(tmp_path):
    events = []
    backend = make_backend(tmp_path, sink=events.append)
    await backend.start()
    try:
        pid = backend.pids()[0]
        chunks, killed_at = [], None
        async for c in backend.generate(request("long", encode(PROMPT), 4000, ignore_eos=True)):
            chunks.append(c)
            if len(chunks) == 3:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
        ended_after = time.monotonic() - killed_at
        final = chunks[-1]
        assert final.finish_reason == "error" and final.error and ended_after < 2.0, (final, ended_after)
        assert final.usage.completion_tokens >= 3
        await until(lambda: backend.stats().restarts == 1, timeout_s=5, what="noticed")
        # the index hears that the slot's KV is gone
        added = [h for e in events if e.kind == "added" for h in e.hashes]
        assert added and events[-1].kind == "evicted" and set(events[-1].hashes) == set(added)
        await until(lambda: backend.stats().healthy, timeout_s=60, what="restarted")
        assert backend.pids()[0] != pid
        again = await collect(backend, request("after", encode(PROMPT), 4))
        assert again[-1].finish_reason == "length" and again[-1].usage.completion_tokens == 4
    finally:
        await backend.close()


async def test_crash_before_the_first_chunk_is_a_503(tmp_path):
    backend = make_backend(tmp_path)
    await backend.start()
    try:
        long_prompt = encode("The sea was calm that night. " * 300)  # seconds of prefill on a CPU
        task = asyncio.create_task(collect(backend, request("x", long_prompt, 4)))
        await until(lambda: backend.stats().running == 1, timeout_s=5, what="sent")
        await asyncio.sleep(0.3)
        assert not task.done()
        os.kill(backend.pids()[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(BackendError) as e:
            await task
        assert e.value.status == 503 and time.monotonic() - t0 < 2.0
    finally:
        await backend.close()


async def test_hung_process_times_out_then_is_replaced(tmp_path):
    backend = make_backend(tmp_path, headers_timeout_s=2.0, health_timeout_s=2.0)
    await backend.start()
    pid = backend.pids()[0]
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(BackendError) as e:
            await collect(backend, request("hang", encode(PROMPT), 4))
        waited = time.monotonic() - t0
        # headers_timeout_s (2 s) without headers, no tokens flowing, then /health unanswered for 2 s
        assert e.value.status == 503 and 3.5 < waited < 7.0, (e.value, waited)
        # /health does not answer either, so the hung process is killed and a new one started
        await until(lambda: backend.stats().restarts == 1, timeout_s=10, what="killed")
        await until(lambda: backend.stats().healthy, timeout_s=60, what="restarted")
        assert not pid_alive(pid)
        chunks = await collect(backend, request("ok", encode(PROMPT), 4))
        assert chunks[-1].finish_reason == "length"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await backend.close()


async def test_slow_but_alive_is_not_a_hang(tmp_path):
    """A prefill longer than headers_timeout_s and stream_idle_timeout_s is waited for while /health answers:
    nothing is killed, and the request is served. This llama-server build sends its headers at once, so the wait is
    for the first event; it was timed by stream_idle_timeout_s (60 s by default), which failed any request whose
    prefill or wait in llama-server's queue took longer."""
    backend = make_backend(tmp_path, headers_timeout_s=0.3, stream_idle_timeout_s=0.3, health_timeout_s=0.3)
    await backend.start()
    try:
        t0 = time.monotonic()
        chunks = await collect(backend, request("slow", encode("The sea was calm that night. " * 150), 2))
        assert time.monotonic() - t0 > 0.6  # the first token took several timeouts' worth of time
        assert chunks[-1].finish_reason == "length" and backend.stats().restarts == 0
    finally:
        await backend.close()


async def test_a_process_that_hangs_after_its_headers_is_found_by_the_first_events_wait(tmp_path):
    """Stopped in the prefill, after the headers came (this build sends them at once): no event within
    headers_timeout_s, no tokens anywhere and no answer to /health within health_timeout_s is a hang (503, the
    process replaced), well before stream_idle_timeout_s."""
    backend = make_backend(tmp_path, headers_timeout_s=1.0, health_timeout_s=1.0, stream_idle_timeout_s=120.0)
    await backend.start()
    pid = backend.pids()[0]
    try:
        chunks = backend.generate(request("hang", encode("The sea was calm that night. " * 300), 2))
        first = asyncio.ensure_future(chunks.__anext__())
        await until(lambda: any(f.resp is not None and f.resp._mode != "head" for f in backend._flights.values()),
                    timeout_s=10, what="headers")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(BackendError) as e:
            await asyncio.wait_for(first, 30)
        waited = time.monotonic() - t0
        assert e.value.status == 503 and "no event within" in e.value.message and waited < 10, (e.value, waited)
        await until(lambda: backend.stats().restarts == 1, timeout_s=10, what="killed")
        assert not pid_alive(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await backend.close()


async def test_close_leaves_no_process_and_is_idempotent(tmp_path):
    backend = make_backend(tmp_path)
    await backend.start()
    pid = backend.pids()[0]
    assert pid_alive(pid) and os.getpgid(pid) == pid  # its own process group
    await backend.close()
    await backend.close()
    assert not pid_alive(pid)
    assert not await backend.health()


WORKER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from tests.integration.llama_server_helpers import make_backend

    async def main():
        backend = make_backend(Path(sys.argv[1]))
        await backend.start()
        print(backend.pids()[0], flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_llama_server_dies_with_a_killed_worker(tmp_path):
    """SIGKILL the worker (no cleanup code runs): the kernel takes llama-server down too (PDEATHSIG)."""
    llama_server_binary()  # skip cleanly when not built
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        line = worker.stdout.readline()
        assert line.strip().isdigit(), f"worker did not start llama-server (exit {worker.poll()})"
        pid = int(line)
        assert pid_alive(pid)
        worker.kill()
        worker.wait()
        assert wait_gone(pid, 5)
    finally:
        worker.kill()
        worker.wait()
