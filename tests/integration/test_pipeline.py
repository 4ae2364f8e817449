"""Pipeline parallelism on the real model (NumPy path): two stage actors in a real local Ray, activations
over real sockets; greedy output identical to the single-stage engine, prefix reuse and speculation still
working with the scheduler and KV manager in the driver, and the EngineBackend hook (`pipeline_stages`)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import ray

from policy.config import PulseConfig, StageConfig
from policy.profiles import builtin_profiles
from tests.integration.engine_helpers import PROMPTS, encode, make_engine, run
from tests.integration.test_speculation import EDIT, SOURCE, always
from workers.cupy.batch import build_batch
from workers.cupy.sequence import Sequence
from workers.cupy.speculative import Speculator
from workers.cupy.weights import load_weights
from workers.pipeline.build import close_pipeline, create_pipelined_engine, gpu_share, split_layers, stage_plan
from workers.pipeline.runner import split_batch
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pipelined(local_ray):
    info = load_model_info(None)
    engine, _ = create_pipelined_engine(
        info, load_weights(info.path), stages_plan=stage_plan(18, [], 2, "cpu"), device="cpu", micro_batches=2,
        block_size=16, num_blocks=1024, max_num_seqs=8, max_step_tokens=512, context_length=info.context_length,
        seed=0)  # 1024 blocks: a sliding-window pool of 549 blocks beside 3399 global ones (kv_cache.plan_pools)
    yield engine
    close_pipeline(engine)


def test_layers_split_evenly_or_as_configured():
    assert split_layers(18, 2) == [9, 9] and split_layers(18, 4) == [5, 5, 4, 4]
    with pytest.raises(ValueError):
        split_layers(2, 3)
    assert stage_plan(18, [], 2, "cpu") == [("cpu", 0, 9), ("cpu", 9, 18)]
    mixed = [StageConfig(device="cuda", layers=12), StageConfig(device="cpu")]
    assert stage_plan(18, mixed, 1, "cpu") == [("cuda", 0, 12), ("cpu", 12, 18)]
    with pytest.raises(ValueError):
        stage_plan(18, [StageConfig(layers=10), StageConfig(layers=10)], 1, "cpu")
    assert gpu_share(2, 1.0) == 0.495 and gpu_share(2, 2.0) == 0.99 and gpu_share(0, 8.0) == 0.0


def test_micro_batches_cut_by_sequence_and_keep_every_logits_row():
    seqs = [Sequence(request_id=str(i), token_ids=list(range(1, n + 1)), max_tokens=4) for i, n in enumerate((7, 1, 1, 5))]
    for s in seqs:
        s.block_table = [len(s.request_id)]
    batch = build_batch([(s, len(s.token_ids)) for s in seqs], 16, np)
    parts = split_batch(batch, 2)
    assert len(parts) == 2
    assert np.concatenate([t for t, _ in parts]).tolist() == batch.token_ids.tolist()
    offsets = np.cumsum([0] + [len(t) for t, _ in parts[:-1]])
    rows = np.concatenate([a["logits_indices"] + o for (_, a), o in zip(parts, offsets)])
    assert rows.tolist() == batch.logits_indices.tolist()
    assert sum(len(a["seq_lens"]) for _, a in parts) == 4 and all(a["query_start"][0] == 0 for _, a in parts)


def test_greedy_output_is_the_single_stage_engines(pipelined):
    prompts = [encode(p) for p in PROMPTS]
    got, _ = run(pipelined, prompts, 12, tag="g")
    want, _ = run(make_engine(), prompts, 12, tag="g")
    assert got == want
    stats = pipelined.model.stats.as_dict()
    assert stats["transport"] == "shm" and stats["stages"] == 2  # same host: arrays through shared memory
    assert stats["bytes_per_token"] > 640 * 4  # at least the residual stream crossed a link
    assert all(s > 0 for s in stats["stage_compute_s"])  # both stages did work


def test_the_tcp_transport_gives_the_same_tokens(pipelined):
    prompts = [encode(p) for p in PROMPTS[:3]]
    want, _ = run(pipelined, prompts, 6, tag="s")
    pipelined.model.rewire(pipelined.pipeline_actors, shm=False)
    try:
        before = pipelined.model.stats.bytes
        got, _ = run(pipelined, prompts, 6, tag="t")
        assert got == want and pipelined.model.stats.transport == "tcp-loopback"
        assert pipelined.model.stats.bytes > before
    finally:
        pipelined.model.rewire(pipelined.pipeline_actors, shm=True)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"pulse-pipe-{os.getpid()}-")][1:]  # old ring gone


def test_cross_step_pipelining_keeps_greedy_output(pipelined):
    """Two groups of sequences in the ring at once (workers/pipeline/overlap.py): same tokens as the
    single-stage engine, also when more requests arrive than slots and when one is aborted mid-flight."""
    prompts = [encode(p) for p in PROMPTS] * 2  # 10 requests, 8 slots: the last two wait for a slot
    want, _ = run(make_engine(), prompts, 6, tag="o")
    pipelined.groups = 2
    try:
        got, _ = run(pipelined, prompts, 6, tag="o")
        assert got == want
        for i, ids in enumerate(prompts[:4]):
            pipelined.add(GenerateRequest(request_id=f"x{i}", prompt_ids=ids, max_tokens=6,
                                          sampling=SamplingParams(temperature=0.0), ignore_eos=True))
        tokens = {f"x{i}": [] for i in range(4)}
        steps = 0
        while pipelined.has_work():
            for out in pipelined.step():
                tokens[out.request_id] += out.token_ids
            steps += 1
            if steps == 3:
                assert pipelined.model.in_flight >= 1  # the engine keeps a step in the ring between calls
                pipelined.abort("x1")
        assert [tokens[f"x{i}"] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
        assert len(tokens["x1"]) < 6 and pipelined.blocks.num_used == 0
    finally:
        pipelined.groups = 0


def test_prefix_reuse_and_speculation_work_across_stages(pipelined):
    prompt, prediction = encode(EDIT), encode(SOURCE)[1:]
    want, _ = run(make_engine(), [prompt], 16, tag="ref")
    pipelined.speculator = Speculator(always(4))
    try:
        first, (f1,) = run(pipelined, [prompt], 16, tag="p1", prediction_ids=prediction)
        second, (f2,) = run(pipelined, [prompt], 16, tag="p2", prediction_ids=prediction)
    finally:
        pipelined.speculator = None
    assert first == want and second == want
    assert f2.cached_tokens >= 16 * (len(prompt) // 16 - 1)  # the second turn reused the first's KV blocks
    assert f1.drafted_tokens > 0 and f1.accepted_tokens > 0


def test_past_the_sliding_window_each_stage_uses_its_local_pool(pipelined):
    """The local layers' block tables and slots travel with each micro-batch; every stage indexes its own
    layers' pool. Tokens as the single-stage engine with one pool (every layer keeping every block)."""
    assert pipelined.blocks.local is not None and pipelined.blocks.local.num_blocks < pipelined.blocks.num_blocks
    prompts = [encode(" ".join(PROMPTS * 12))[:700], encode(PROMPTS[2])]
    want, _ = run(make_engine(window_pool=False), prompts, 8, tag="w")
    got, _ = run(pipelined, prompts, 8, tag="w")
    assert got == want


async def test_engine_backend_runs_a_pipeline_from_config(local_ray):
    from workers.cupy.backend import EngineBackend

    config = PulseConfig.model_validate({"workers": {"engine": {
        "kv_blocks": 64, "max_num_seqs": 2, "pipeline_stages": 2, "speculation": False}}})
    backend = EngineBackend(config, builtin_profiles()["cpu"], load_model_info(None))
    await backend.start()
    try:
        req = GenerateRequest(request_id="b0", prompt_ids=encode(PROMPTS[0]), max_tokens=4,
                              sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        chunks = [c async for c in backend.generate(req)]
        assert "".join(c.text for c in chunks).strip()
        stats = backend.pipeline_stats()
        assert stats["stages"] == 2 and stats["steps"] >= 4
    finally:
        await backend.close()
