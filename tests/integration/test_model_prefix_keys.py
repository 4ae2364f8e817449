"""Two models that share a tokenizer never share prefix keys, end to end through real parts.

The bundled SmolLM2 and a copy with one weight byte changed (a different model, the same tokenizer and
prompt ids), each held by a real worker (WorkerActor, in-process, running a real llama-server), seen by the
gateway's real pool, in-process index and router: each worker's published blocks are exactly the chain the
router computes from that worker's WorkerInfo.prefix_seed, the two chains are disjoint, and a prompt cached
by one model is no prefix hit for the other. A worker sent the other model's request refuses it. Each model's
own KV budget reaches its workers.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from cache.hashing import chain_hashes
from cache.memory_index import MemoryPrefixIndex
from gateway.pool import WorkerPool, iter_batches
from gateway.router import PrefixRouter
from policy.config import PulseConfig, RoutingConfig
from tests.integration.llama_server_helpers import llama_server_binary
from workers.actor import WorkerActor
from workers.protocol import BackendError, GenerateRequest, SamplingParams
from workers.protocol.model import gguf_identity, load_model_info, load_tokenizer, resolve_model_path

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> str:
    """SmolLM2 with its last byte (tensor data) flipped: another model under the same tokenizer."""
    path = tmp_path_factory.mktemp("twin") / "smollm2-twin.gguf"
    shutil.copyfile(resolve_model_path(SMOL), path)
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 1]))
    return str(path)


def test_the_identity_is_the_gguf_content_not_its_path_or_name(twin, tmp_path):
    same = tmp_path / "renamed.gguf"
    shutil.copyfile(resolve_model_path(SMOL), same)
    smol = gguf_identity(resolve_model_path(SMOL))
    assert smol == load_model_info(SMOL).identity and smol.startswith("gguf:")
    assert gguf_identity(same) == smol != gguf_identity(Path(twin))


def config(tmp_path, models: list[dict]) -> PulseConfig:
    ls = {"binary": str(llama_server_binary()), "slots": 1, "kv_tokens": 1024, "threads": 1,
          "log_dir": str(tmp_path), "headers_timeout_s": 20.0, "stop_grace_s": 3.0}
    return PulseConfig.model_validate({"workers": {"backend": "llama-server", "llama_server": ls},
                                       "models": models})


@pytest_asyncio.fixture
async def fleet(twin, tmp_path):
    """Two real workers (one per model) and the gateway's pool feeding an in-process index."""
    # smol-b has a KV budget of its own; smol-a takes the workers' (llama_server.kv_tokens: 1024)
    cfg = config(tmp_path, [{"name": "smol-a", "path": SMOL}, {"name": "smol-b", "path": twin, "kv_tokens": 2048}])
    actors = [WorkerActor(cfg.for_model(m).model_dump_json(), f"w-{m.name}") for m in cfg.models]
    index = MemoryPrefixIndex()
    pool = None
    try:
        infos = [await a.start() for a in actors]

        async def discover(worker_id):
            return [i for i in infos if worker_id in (None, i.worker_id)]

        pool = WorkerPool(discover, block_index=index)
        await pool.start()
        yield pool, index, actors
    finally:
        if pool is not None:
            await pool.close()
        for a in actors:
            await a.close()


def gen(rid: str, ids: list[int], model: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=ids, max_tokens=2, model=model,
                           sampling=SamplingParams(temperature=0.0))


async def run(pool: WorkerPool, w, req: GenerateRequest):
    """The final chunk of one generation on worker `w`."""
    resp = await pool.open_stream(w, req)
    try:
        async for batch in iter_batches(resp):
            if batch[-1].finish_reason:
                return batch[-1]
    finally:
        resp.close()


PROMPT_TEXT = "A list of the planets of the solar system, in order from the sun, with one fact about each: " * 3


async def test_each_models_blocks_are_its_own_and_the_router_finds_them(fleet):
    pool, index, _ = fleet
    a, b = pool.workers["w-smol-a"], pool.workers["w-smol-b"]
    assert a.info.prefix_seed and b.info.prefix_seed and a.info.prefix_seed != b.info.prefix_seed
    assert a.info.prefix_seed == load_model_info(SMOL).chain_root.hash  # the worker's seed is its model's
    ids = load_tokenizer(SMOL).encode(PROMPT_TEXT, add_special_tokens=False).ids
    assert len(ids) >= 48
    router = PrefixRouter(index, RoutingConfig())

    await run(pool, a, gen("a1", ids, "smol-a"))
    await pool.poll_once()  # pulls the workers' block logs into the index
    ha, hb = chain_hashes(ids, 16, a.info.prefix_seed), chain_hashes(ids, 16, b.info.prefix_seed)
    assert not set(ha) & set(hb)
    # the gateway's lookup names exactly the blocks the worker published
    assert await index.longest_prefix(ha) == {"w-smol-a": len(ha)}
    assert (await router.choose([a], gen("a2", ids, "smol-a"))).cached_tokens == 16 * len(ha)
    # the same prompt ids under the other model: no hit, not even one to ignore
    assert await index.longest_prefix(hb) == {}
    assert (await router.choose([b], gen("b1", ids, "smol-b"))).cached_tokens == 0

    await run(pool, b, gen("b2", ids, "smol-b"))
    await pool.poll_once()
    assert await index.longest_prefix(hb) == {"w-smol-b": len(hb)}
    assert await index.longest_prefix(ha) == {"w-smol-a": len(ha)}  # each entry lists one model's worker


async def test_a_worker_refuses_a_model_it_does_not_hold(fleet):
    """Sent another model's request (a gateway with a stale view), a worker answers 421 naming both models
    and generates nothing; a request naming its model, or none, is served."""
    pool, _, actors = fleet
    a, slot = pool.workers["w-smol-a"], actors[0].backend.lanes[0].slots.slots[0]
    ids = load_tokenizer(SMOL).encode("The capital of France is", add_special_tokens=False).ids
    with pytest.raises(BackendError) as refused:
        await run(pool, a, gen("x1", ids, "smol-b"))
    assert refused.value.status == 421
    assert "smol-a" in refused.value.message and "smol-b" in refused.value.message
    assert slot.tokens == []  # it never reached llama-server's slot
    assert (await run(pool, a, gen("x2", ids, "smol-a"))).usage.completion_tokens == 2
    assert slot.tokens[: len(ids)] == ids
    assert (await run(pool, a, gen("x3", ids, ""))).usage.completion_tokens == 2


async def test_each_model_gets_its_own_kv_budget(fleet):
    """A model's `kv_tokens` reaches its workers (llama-server's -c, the KV blocks routing and admission see);
    a model without one takes the workers' setting."""
    pool, _, actors = fleet
    for actor, name, tokens in zip(actors, ("w-smol-a", "w-smol-b"), (1024, 2048)):
        assert pool.workers[name].stats.kv_blocks_total == tokens // 16
        async with aiohttp.ClientSession() as http:
            async with http.get(actor.backend.lanes[0].process.url + "/props") as r:
                props = await r.json()
        assert props["default_generation_settings"]["n_ctx"] == tokens
