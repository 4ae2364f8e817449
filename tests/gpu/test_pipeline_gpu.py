"""Two pipeline stages sharing one GPU against the single-stage GPU engine: identical greedy tokens on the
real model (prompts from test_gemma3_gpu.py, one past the 512-token sliding window), micro-batched decode,
every hop device to device through CUDA IPC (the default on one host) and visible in the pipeline's stats;
cross-step pipelining, the shared-memory and the TCP transports give the same tokens; a killed stage process is rebuilt and the requests that had no output yet are served. Stages start as Ray actors where Ray is installed, else as
plain processes (the same StageActor; the GPU benchmark machine has no Ray)."""
from __future__ import annotations

import importlib.util
import os
import signal

import pytest

pytest.importorskip("cupy")

from tests.gpu.test_gemma3_gpu import PROMPTS, model_path  # noqa: E402
from tests.required import absent  # noqa: E402

LAUNCHER = "ray" if importlib.util.find_spec("ray") else "process"


@pytest.fixture(scope="module")
def engines():
    path = model_path()
    if path is None or not path.exists():
        absent("no GGUF model (set PULSE_GGUF)", env="PULSE_REQUIRE_GPU")
    from workers.cupy.gpu import create_gpu_engine
    from workers.cupy.weights import load_weights
    from workers.pipeline.build import close_pipeline, create_pipelined_engine, stage_plan
    from workers.protocol.model import load_model_info, load_tokenizer

    if LAUNCHER == "ray":
        import ray

        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    info = load_model_info(str(path))
    weights = load_weights(path)
    kw = dict(block_size=16, num_blocks=512, max_num_seqs=8, max_step_tokens=1024, context_length=2048)
    single = create_gpu_engine(info, weights, **kw)
    pipe, _ = create_pipelined_engine(info, weights, stages_plan=stage_plan(info.hparams["gemma3.block_count"], [], 2,
                                                                            "cuda"),
                                      device="cuda", micro_batches=2, model_path=str(path), launcher=LAUNCHER, **kw)
    yield info, load_tokenizer(str(path)), single, pipe
    close_pipeline(pipe)
    if LAUNCHER == "ray":
        import ray

        ray.shutdown()


def generate(engine, ids_list, n):
    from workers.protocol import GenerateRequest, SamplingParams

    for i, ids in enumerate(ids_list):
        engine.add(GenerateRequest(request_id=str(i), prompt_ids=ids, max_tokens=n,
                                   sampling=SamplingParams(temperature=0.0), ignore_eos=True))
    out = {str(i): [] for i in range(len(ids_list))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return [out[str(i)] for i in range(len(ids_list))]


def test_two_stages_on_one_gpu_give_the_single_stage_greedy_tokens(engines):
    info, tok, single, pipe = engines
    ids = [[info.bos_token_id] + tok.encode(t).ids for t in PROMPTS]
    want = generate(single, ids, 32)
    got = generate(pipe, ids, 32)
    for i in range(len(PROMPTS)):
        assert got[i] == want[i], f"prompt {i}"
    stats = pipe.model.stats.as_dict()
    assert stats["stages"] == 2 and stats["transport"] == "cuda_ipc"  # one host, CUDA at every end
    # every message made all three hops (driver -> stage 0 -> stage 1 -> driver) through CUDA IPC
    assert stats["messages"] > 0 and stats["ipc_hops"] == 3 * stats["messages"] and stats["ipc_fallbacks"] == 0
    assert stats["bytes_per_token"] > 640 * 4 and all(s > 0 for s in stats["stage_compute_s"])
    print("pipeline stats:", stats)


def test_cross_step_pipelining_and_the_tcp_transport_keep_the_tokens(engines):
    info, tok, single, pipe = engines
    ids = [[info.bos_token_id] + tok.encode(t).ids for t in PROMPTS]
    want = generate(single, ids, 16)
    pipe.groups = 2  # workers/pipeline/overlap.py
    try:
        assert generate(pipe, ids, 16) == want
    finally:
        pipe.groups = 0
    for shm, name in ((False, "tcp-loopback"), (True, "shm")):  # the host transports, same stages
        pipe.model.rewire(pipe.pipeline_actors, shm=shm)
        try:
            hops = pipe.model.stats.ipc_hops
            assert generate(pipe, ids, 16) == want and pipe.model.stats.transport == name
            assert pipe.model.stats.ipc_hops == hops  # nothing went through CUDA IPC
        finally:
            pipe.model.rewire(pipe.pipeline_actors, shm=True, ipc=True)
    assert pipe.model.stats.transport == "cuda_ipc"


def test_cuda_ipc_with_one_and_with_several_micro_batches_in_flight(engines):
    """pipe1 / pipe / cross-step over CUDA IPC: more messages in the ring at once, slots reused many times."""
    info, tok, single, pipe = engines
    ids = [[info.bos_token_id] + tok.encode(f"{t} ({i})").ids for i, t in enumerate(PROMPTS * 2)][:8]
    want = generate(single, ids, 24)
    before = pipe.model.stats.as_dict()
    try:
        for mb, groups in ((1, 0), (2, 0), (2, 2)):
            pipe.model.micro_batches, pipe.groups = mb, groups
            assert generate(pipe, ids, 24) == want, (mb, groups)
    finally:
        pipe.model.micro_batches, pipe.groups = 2, 0
    after = pipe.model.stats.as_dict()
    messages = after["messages"] - before["messages"]
    assert after["ipc_hops"] - before["ipc_hops"] == 3 * messages and after["ipc_fallbacks"] == 0


def test_a_killed_stage_is_rebuilt_on_the_gpu(engines):
    from workers.pipeline.runner import StageLost
    from workers.protocol import GenerateRequest, SamplingParams

    info, tok, single, pipe = engines
    ids = [[info.bos_token_id] + tok.encode(t).ids for t in PROMPTS[:2]]
    want = generate(single, ids, 8)
    before = pipe.pipeline_actors.pids()
    os.kill(before[1], signal.SIGKILL)
    for i, p in enumerate(ids):
        pipe.add(GenerateRequest(request_id=f"k{i}", prompt_ids=p, max_tokens=8,
                                 sampling=SamplingParams(temperature=0.0), ignore_eos=True))
    out = {f"k{i}": [] for i in range(len(ids))}
    while pipe.has_work():
        try:
            for o in pipe.step():
                out[o.request_id] += o.token_ids
        except StageLost as exc:
            assert not pipe.pipeline_recovery.run(exc)  # nothing had streamed: every request is requeued
    assert [out[f"k{i}"] for i in range(len(ids))] == want
    after = pipe.pipeline_actors.pids()
    assert after[0] == before[0] and after[1] != before[1] and pipe.model.stats.rebuilds == 1
