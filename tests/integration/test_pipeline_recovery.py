"""A pipeline stage's process killed mid-run (issue 10): the request that was streaming ends with a clear
error, a queued request is served once the stage is back, the stage is restarted by Ray, the prefix
cache the router knew of is reported evicted, and the next requests get the same greedy tokens as before.
Real local Ray, two NumPy stage actors, the bundled model, the real EngineBackend."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray

from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from tests.integration.engine_helpers import encode
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info

pytestmark = pytest.mark.slow

PROMPT = ("The lighthouse keeper climbed the stairs every evening, lit the lamp and watched the ships pass "
          "the rocks; one stormy night he saw")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def request(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=encode(PROMPT), max_tokens=max_tokens,
                           sampling=SamplingParams(temperature=0.0), ignore_eos=True)


async def tokens_of(backend, req: GenerateRequest) -> tuple[list[int], object]:
    chunks = [c async for c in backend.generate(req)]
    return [t for c in chunks for t in c.token_ids], chunks[-1]


async def test_a_killed_stage_is_rebuilt_and_serves_the_same_tokens(local_ray):
    from workers.cupy.backend import EngineBackend

    events = []
    config = PulseConfig.model_validate({"workers": {"engine": {
        "kv_blocks": 64, "max_num_seqs": 1, "pipeline_stages": 2, "speculation": False}}})
    backend = EngineBackend(config, builtin_profiles()["cpu"], load_model_info(None), block_sink=events.append)
    await backend.start()
    try:
        stages = backend._engine.pipeline_actors
        want, _ = await tokens_of(backend, request("ref", 6))
        cached = {h for e in events if e.kind == "added" for h in e.hashes}
        assert cached, "the prompt filled at least one block the router was told about"
        pids = stages.pids()

        # one request streaming, one queued behind it (one slot); stage 0 killed once the first has output
        queued = asyncio.ensure_future(tokens_of(backend, request("queued", 6)))
        chunks = []
        async for c in backend.generate(request("streaming", 400)):
            if not chunks:
                os.kill(pids[0], signal.SIGKILL)
            chunks.append(c)
        final = chunks[-1]
        assert final.finish_reason == "error" and "stage was lost" in final.error, final
        assert len([t for c in chunks for t in c.token_ids]) < 400
        got, last = await asyncio.wait_for(queued, 120)
        assert got == want and last.finish_reason == "length"  # served after the rebuild, as if nothing happened

        new_pids = await asyncio.to_thread(stages.pids)
        assert new_pids[0] != pids[0] and new_pids[1] == pids[1]  # Ray restarted the dead one only
        evicted = {h for e in events if e.kind == "evicted" for h in e.hashes}
        assert cached <= evicted  # the router hears that this worker's prefix blocks are gone
        assert await backend.health()

        # the last stage killed while idle: the next request's first step finds it gone, is put back, and
        # served once the stage is back (a retry before its first token, on this worker)
        os.kill(new_pids[1], signal.SIGKILL)
        got, last = await asyncio.wait_for(tokens_of(backend, request("after", 6)), 120)
        assert got == want and last.finish_reason == "length"
        assert backend._engine.pipeline_recovery.recoveries == 2
        stats = backend.stats()  # what /metrics shows: pulse_worker_pipeline_rebuilds_total, _transport
        assert stats.pipeline_rebuilds == 2 and stats.pipeline_transport == "shm"
        seen = set(pids) | set(new_pids) | set(await asyncio.to_thread(stages.pids))
    finally:
        await backend.close()
    # the killed stages' shared-memory rings (and the closed ones') are removed, not left in /dev/shm
    assert not [f for f in os.listdir("/dev/shm") if any(f.startswith(f"pulse-pipe-{p}-") for p in seen)]
