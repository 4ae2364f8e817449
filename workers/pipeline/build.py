"""Building a pipelined engine: split the layers, place and wire the stage actors, build the driver's ends.

Placement decides the transport: every hop is a direct TCP socket (loopback when all stages share the
driver's host, the network otherwise); on one host the arrays go through shared memory, and a hop whose two
ends are CUDA processes on one host moves the residual stream device to device through CUDA IPC
(cuda_ipc.py). The name goes into the pipeline stats. Ray only places the actors.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, as even as possible, earlier stages taking the remainder."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def stage_plan(n_layers: int, stages: list, count: int, device: str) -> list[tuple[str, int, int]]:
    """(device, first layer, end) per stage, from `stages` (each with device and layers, a count or None
    for an even share of what is left) or else `count` even stages on `device`."""
    if not stages:
        sizes = split_layers(n_layers, count)
        devices = [device] * count
    else:
        fixed = sum(s.layers or 0 for s in stages)
        free = [i for i, s in enumerate(stages) if not s.layers]
        share = split_layers(n_layers - fixed, len(free)) if free else []
        sizes = [s.layers or share[free.index(i)] for i, s in enumerate(stages)]
        devices = [s.device for s in stages]
    if sum(sizes) != n_layers:
        raise ValueError(f"pipeline stages hold {sum(sizes)} layers; the model has {n_layers}")
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return [(d, lo, hi) for d, lo, hi in zip(devices, bounds, bounds[1:])]


def start_stages(plan, model_path, cache_dir, *, bind_host="127.0.0.1", act="float16", max_model_len=8192,
                 cpu_threads=1, resources=None, launcher="ray"):
    """The stage actors, created and loaded (returns once every stage holds its weights and listens)."""
    from workers.pipeline.launch import ProcessStages, RayStages

    specs = [dict(model_path=model_path, cache_dir=cache_dir, lo=lo, hi=hi, device="cpu" if dev == "cpu" else "cuda",
                  last=i == len(plan) - 1, bind_host=bind_host, act=act, max_model_len=max_model_len,
                  cpu_threads=cpu_threads) for i, (dev, lo, hi) in enumerate(plan)]
    if launcher == "process":
        return ProcessStages(specs)
    import ray

    n_gpu_stages = sum(dev != "cpu" for dev, _, _ in plan)
    share = gpu_share(n_gpu_stages, ray.cluster_resources().get("GPU", 0.0))
    # on a CPU box stages take no CPU reservation (the driver and the gateway already hold the box's cores,
    # and Ray would otherwise refuse to place them)
    return RayStages(specs, [0.0 if dev == "cpu" else share for dev, _, _ in plan], resources)


def gpu_share(n_gpu_stages: int, cluster_gpus: float) -> float:
    """Ray GPU reservation per GPU stage: nearly a whole GPU each when there are enough GPUs (0.99 cannot
    be packed two to a GPU, so Ray spreads the stages; the driver's 0.01 for its embeddings and head fits
    beside one), else an even share of one GPU."""
    if n_gpu_stages == 0:
        return 0.0
    return 0.99 if cluster_gpus >= n_gpu_stages else round(0.99 / n_gpu_stages, 4)


def transport_name(addresses, driver_host: str, shm: bool = True) -> str:
    """"shm" (header on a loopback socket, arrays through shared memory) when every stage is on the
    driver's host and `shm`; else "tcp-loopback" or "tcp"."""
    hosts = {h for h, _ in addresses} | {driver_host}
    if hosts <= {"127.0.0.1", "localhost"} or len(hosts) == 1:
        return "shm" if shm else "tcp-loopback"
    return "tcp"


def ipc_hops(addresses, stages_plan, driver_host: str, driver_device: str, enabled: bool) -> list[bool]:
    """Per hop of the ring (driver -> stage 0 ... last stage -> driver): CUDA IPC or not, by placement."""
    from workers.pipeline import cuda_ipc

    ends = [cuda_ipc.End(driver_host, driver_device)]
    ends += [cuda_ipc.End(host, "cpu" if dev == "cpu" else "cuda") for (host, _), (dev, _, _) in zip(addresses, stages_plan)]
    return cuda_ipc.plan_hops(ends, enabled, enabled and driver_device != "cpu" and cuda_ipc.available())


def ring_spec(micro_batches: int, max_step_tokens: int, hidden: int) -> tuple[int, int]:
    """(slots, slot bytes) of each CUDA IPC hop's device ring: slots for more messages than the driver keeps
    in flight (one per micro-batch or group; cuda_ipc.py says why that bounds every hop) with two to spare,
    each slot the largest message (a whole step's tokens of fp32 residual)."""
    return max(4, micro_batches + 2), max_step_tokens * hidden * 4


def create_pipelined_engine(info, weights, *, stages_plan, device: str, micro_batches: int, model_path=None,
                            cache_dir=None, block_size: int, num_blocks: int, max_num_seqs: int,
                            max_step_tokens: int, context_length: int, block_sink=None, bind_host="127.0.0.1",
                            cpu_threads=1, resources=None, seed=None, launcher="ray", graphs=True, overlap=False,
                            shm=True, window_pool=True, cuda_ipc=True):
    """An Engine whose model is a PipelinedModel over stage actors; (engine, stages). `overlap`: cross-step
    pipelining (workers/pipeline/overlap.py), one group of sequences per micro-batch. `shm`: same-host hops
    move their arrays through shared memory (workers/pipeline/shm.py). `cuda_ipc`: hops between CUDA
    processes of one host move the residual stream device to device (workers/pipeline/cuda_ipc.py).
    `window_pool`: the sliding-window layers' own KV pool (workers/cupy/kv_cache.plan_pools)."""
    from workers.cupy.gemma3 import Gemma3Config
    from workers.cupy.kv_cache import BlockManager, plan_for
    from workers.cupy.sampler import Sampler
    from workers.cupy.scheduler import Scheduler
    from workers.pipeline.overlap import OverlapEngine
    from workers.pipeline.recovery import LiveBlocks, StageRecovery
    from workers.pipeline.runner import PipelinedModel

    if info.architecture != "gemma3":  # the stage layers (layers.py, gpu.py) are Gemma 3's
        raise ValueError(f"pipeline stages run gemma3 models only; {info.architecture!r} runs on one worker "
                         "(leave pipeline_stages at 1)")
    cfg = Gemma3Config.from_hparams(info.hparams, info.vocab_size)
    stages = start_stages(stages_plan, model_path, cache_dir, bind_host=bind_host, max_model_len=context_length,
                          cpu_threads=cpu_threads, resources=resources, launcher=launcher)
    addresses = stages.addresses
    if device == "cpu":
        from workers.pipeline.layers import NumpyEnds

        ends = NumpyEnds(cfg, weights)
    else:
        from workers.pipeline.gpu import GpuEnds

        ends = GpuEnds(cfg, weights)
    n = len(addresses)
    driver_host = bind_host if bind_host != "0.0.0.0" else _node_ip()
    transport = transport_name(addresses, driver_host, shm)
    mb = micro_batches or n
    # the hops that could use CUDA IPC are planned even when it is off, so the bench can rewire onto it
    hops = ipc_hops(addresses, stages_plan, driver_host, device, True)
    model = PipelinedModel(ends, n, transport, mb, bind_host, driver_host, hops,
                           ring_spec(mb, max_step_tokens, cfg.hidden), ipc=cuda_ipc)
    model.wire(stages)
    log.info("pipeline: %d stages %s over %s", n, stages_plan, model.stats.transport)
    plan = plan_for(cfg, num_blocks, block_size, max_num_seqs, max_step_tokens, window_pool)
    kv = model.kv_storage(plan.num_global, block_size, max_seqs=max_num_seqs if graphs else 0,
                          num_local=plan.num_local)
    live = LiveBlocks(block_sink)  # what the router was told: all of it evicted if a stage is lost
    blocks = BlockManager.from_plan(plan, block_size, live, info.chain_root)
    scheduler = Scheduler(blocks, max_num_seqs, max_step_tokens)
    if device == "cpu":
        sampler = Sampler(np)
    else:
        from workers.cupy.gpu import GpuSampler

        sampler = GpuSampler(model)
    engine = OverlapEngine(model, kv, blocks, scheduler, sampler, info.eos_token_ids, context_length,
                           info.vocab_size, seed)
    engine.groups = model.micro_batches if overlap else 0
    if device != "cpu":
        sampler.engine = engine
    engine.pipeline_actors = stages  # kept alive with the engine; ended by close_pipeline
    engine.pipeline_recovery = StageRecovery(engine, stages, live)
    return engine, stages


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def close_pipeline(engine) -> None:
    engine.model.close()
    stages = getattr(engine, "pipeline_actors", None)
    if stages is not None:
        stages.close()


def build_for_backend(info, weights, engine_cfg, xp, sizes: dict, block_sink, multi_host: bool):
    """EngineBackend's hook: the pipelined engine its config asks for (`pipeline_stages` or `stages`)."""
    device = "cpu" if xp is np else "cuda"
    plan = stage_plan(info.hparams[f"{info.architecture}.block_count"], engine_cfg.stages,
                      engine_cfg.pipeline_stages, device)
    engine, _ = create_pipelined_engine(
        info, weights, stages_plan=plan, device=device, micro_batches=engine_cfg.micro_batches,
        model_path=str(info.path), cache_dir=engine_cfg.cache_dir, block_sink=block_sink,
        bind_host="0.0.0.0" if multi_host else "127.0.0.1", cpu_threads=engine_cfg.cpu_threads,
        overlap=engine_cfg.pipeline_overlap, cuda_ipc=engine_cfg.pipeline_cuda_ipc, **sizes)
    return engine
