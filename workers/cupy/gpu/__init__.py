"""The engine's CUDA half: fused kernels, cuBLAS through ctypes, decode steps as CUDA graphs.

- kernels.cu / kernels.py  fused RMSNorm(+residual), QK-norm + RoPE + KV write, paged attention for mixed
                           prefill/decode steps, gelu * up, argmax, graph input preparation
- cublas.py                cublasGemmEx via ctypes (capturable in CUDA graphs, unlike CuPy's cuBLAS calls)
- gemma3.py                GpuGemma3: the model on those kernels, same interface as workers/cupy/gemma3.Gemma3
- llama.py, llama.cu       GpuLlama: Llama-family models on the same machinery (RoPE + KV write, residual norm,
                           silu * up kernels; GQA through the shared attention kernel)
- graphs.py                decode steps captured once per batch size and replayed
- NOTES.md                 measurements, predictions and outcomes (the GPU work log)

Hook: `create_gpu_engine` builds the same Engine (scheduler, paged KV with prefix reuse, sampler) around
the architecture's GPU model (models.build_gpu_model). The worker's backend uses it when the array
module is CuPy.
"""
from __future__ import annotations

import numpy as np

from workers.cupy.sampler import Sampler


class GpuSampler(Sampler):
    """The engine's sampler, except that an all-greedy step takes the ids the model's argmax kernel already
    chose inside the step (its CUDA graph), so only B int32 cross to the host."""

    def __init__(self, model, **kw):
        import cupy

        super().__init__(cupy, **kw)
        self.model = model
        self.engine = None  # set by create_gpu_engine: grammar masks (engine.constraints) void the kernel's argmax

    def _masked(self) -> bool:
        c = getattr(self.engine, "constraints", None)
        return c is not None and bool(getattr(c, "_matchers", True))

    def sample(self, logits, rows):
        chosen = getattr(self.model, "last_chosen", None)
        # only for the very logits the step returned (not a subset of rows, as speculative verification
        # passes) and not masked in place by a grammar
        if (chosen is not None and logits is getattr(self.model, "last_logits", None)
                and chosen.shape[0] == len(rows) and not self._masked()
                and all((r.params.temperature <= 0 or r.params.top_k == 1) and r.logprobs is None for r in rows)):
            return chosen.get().astype(np.int64), [None] * len(rows)
        return super().sample(logits, rows)


def create_gpu_engine(info, weights: dict, *, block_size: int, num_blocks: int, max_num_seqs: int,
                      max_step_tokens: int, context_length: int, block_sink=None, seed: int | None = None,
                      act: str = "float16", graph_sizes=None, window_pool: bool = True, **_ignored):
    """An Engine whose model is the architecture's GPU model (models.build_gpu_model: fp16/bf16 weights, CUDA
    graphs for decode batches up to max_num_seqs). Same arguments as workers.cupy.engine.create_engine
    (`window_pool`: the sliding-window layers' own KV pool, kv_cache.plan_pools); `ops`/`dtype` are ignored."""
    from workers.cupy.engine import Engine
    from workers.cupy.kv_cache import BlockManager, plan_for
    from workers.cupy.models import build_gpu_model
    from workers.cupy.scheduler import Scheduler

    if graph_sizes is None:
        graph_sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s < max_num_seqs) + (max_num_seqs,)
    model = build_gpu_model(info, weights, act=act, graph_sizes=graph_sizes, max_model_len=context_length)
    cfg = model.cfg
    plan = plan_for(cfg, num_blocks, block_size, max_num_seqs, max_step_tokens, window_pool)
    kv = model.kv_storage(plan.num_global, block_size, num_local=plan.num_local)
    blocks = BlockManager.from_plan(plan, block_size, block_sink)
    scheduler = Scheduler(blocks, max_num_seqs, max_step_tokens)
    sampler = GpuSampler(model)
    engine = Engine(model, kv, blocks, scheduler, sampler, info.eos_token_ids, context_length, info.vocab_size, seed)
    sampler.engine = engine
    return engine
