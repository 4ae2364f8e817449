"""The engine in a process of its own (workers/cupy/engine_process.py), on the real model (NumPy path): what
happens when either process dies, and grammars compiled across the process boundary.

The streaming behaviour itself is checked with the engine process by test_engine_backend.py and
test_backend_contract.py (both run every test against both placements)."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import pytest_asyncio

from bench.procs import alive, wait_gone
from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from tests.integration.engine_helpers import PROMPTS, encode
from workers.cupy.backend import EngineBackend
from workers.protocol import BackendError, GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
GREEDY = SamplingParams(temperature=0.0)
CONFIG = {"workers": {"engine": {"kv_blocks": 128, "max_num_seqs": 4, "process": "on"}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend():
    b = EngineBackend(PulseConfig.model_validate(CONFIG), builtin_profiles()["cpu"], load_model_info(None))
    await b.start()
    yield b
    await b.close()


def req(rid: str, **kw) -> GenerateRequest:
    kw.setdefault("max_tokens", 12)
    return GenerateRequest(request_id=rid, prompt_ids=encode(PROMPTS[1]), sampling=GREEDY, ignore_eos=True, **kw)


async def collect(backend, request):
    return [c async for c in backend.generate(request)]


async def wait_healthy(backend, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await backend.health() and backend.stats().healthy:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not healthy again after {timeout_s} s: {backend.stats()}")


async def test_a_killed_engine_process_ends_its_streams_with_an_error_and_comes_back(backend):
    before = "".join(c.text for c in await collect(backend, req("before")))
    pid = backend._proc.proc.pid
    chunks = []

    async def consume():
        async for c in backend.generate(req("long", max_tokens=2000)):
            chunks.append(c)
            if len(chunks) == 2:
                os.kill(pid, signal.SIGKILL)

    await asyncio.wait_for(consume(), 60)  # ends, does not hang
    assert chunks[-1].finish_reason == "error" and "engine process" in chunks[-1].error
    assert sum(len(c.token_ids) for c in chunks) < 2000
    # until the new engine is built (seconds: a Python start and the weights): refused, not queued into nothing
    assert not backend.stats().healthy and not await backend.health()
    with pytest.raises(BackendError) as err:
        await collect(backend, req("while-down"))
    assert err.value.status == 503
    await wait_healthy(backend)
    assert backend._proc.proc.pid != pid and not alive(pid)
    after = "".join(c.text for c in await collect(backend, req("after")))
    assert after == before  # the same model, the same greedy tokens


async def test_grammars_compile_in_the_engine_process(backend):
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False})
    chunks = await collect(backend, GenerateRequest(request_id="g", prompt_ids=encode(PROMPTS[0]), max_tokens=40,
                                                    sampling=GREEDY, grammar=schema))
    assert chunks[-1].finish_reason == "stop"
    assert set(json.loads("".join(c.text for c in chunks))) == {"city"}
    with pytest.raises(BackendError) as err:
        await collect(backend, GenerateRequest(request_id="bad-g", prompt_ids=encode(PROMPTS[0]), max_tokens=4,
                                               grammar='{"type": "object", "properties": {"a": {"type": "nope"}}}'))
    assert err.value.status == 400 and "grammar" in err.value.message


WORKER = """
import asyncio, sys
from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from workers.cupy.backend import EngineBackend
from workers.protocol.model import load_model_info

async def main():
    b = EngineBackend(PulseConfig.model_validate({config!r}), builtin_profiles()["cpu"], load_model_info(None))
    await b.start()
    print(b._proc.proc.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_the_engine_process_exits_when_its_worker_is_killed():
    """SIGKILL gives the worker no chance to stop its engine: the engine process sees its socket close."""
    await asyncio.to_thread(_kill_a_worker)


def _kill_a_worker() -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(config=CONFIG)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(worker.stdout.readline())
        assert alive(engine_pid)
        worker.kill()
        worker.wait(timeout=10)
        assert wait_gone(engine_pid, 15)
    finally:
        worker.kill()


async def test_the_engine_process_freezes_its_built_engine_out_of_garbage_collection_only_when_told(backend):
    """workers.engine.quiet_gc (off by default): on, the engine process collects and freezes what exists once its
    engine is built, and says how many objects it froze; off, it keeps Python's collector as it is. Either way it
    serves the same tokens."""
    assert backend.stats().gc_frozen == 0
    assert "".join(c.text for c in await collect(backend, req("plain")))
    quiet = EngineBackend(PulseConfig.model_validate({"workers": {"engine": {**CONFIG["workers"]["engine"],
                                                                             "quiet_gc": True}}}),
                          builtin_profiles()["cpu"], load_model_info(None))
    await quiet.start()
    try:
        assert quiet.stats().gc_frozen > 10_000  # the model, the KV pools' blocks, the imported modules
        assert "".join(c.text for c in await collect(quiet, req("quiet"))) == "".join(
            c.text for c in await collect(backend, req("plain-again")))  # greedy: the same tokens either way
    finally:
        await quiet.close()
