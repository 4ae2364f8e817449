"""The engine's CUDA half: fused kernels, cuBLAS through ctypes, decode steps as CUDA graphs.

- kernels.cu / kernels.py  fused RMSNorm(+residual), QK-norm + RoPE + KV write, paged attention for mixed
                           prefill/decode steps, gelu * up, graph input preparation
- sampling.cu              argmax fused with the sampler's draw (Gumbel-max, counter-based noise), logprobs
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

import ctypes

import numpy as np

from workers.cupy.sampler import ASK_ALTERNATIVES, ASK_LOGPROBS, ASK_TRUNCATED, Sampler, rows_ask
from workers.protocol import TokenLogprob


class GpuSampler(Sampler):
    """The engine's sampler with the draw inside the step: before each forward the engine stages the rows'
    parameters (`stage`) into the model's DeviceDraws, the step's argmax kernel (inside its CUDA graph)
    draws every row by sampler.py's rule, and `sample` copies back only the ids (and logprobs when asked).
    Rows the step could not draw (top-k/top-p/min-p, top alternatives, grammar-masked logits, a forward
    that was not staged) take the eager path: the same rule, the same kernel, launched on their logits."""

    def __init__(self, model, rows: int = 1024, **kw):
        import cupy

        super().__init__(cupy, **kw)
        self.model = model
        self.engine = None  # set by create_gpu_engine
        kernels = getattr(model, "kernels", None)
        self.draws = None
        if kernels is not None and hasattr(kernels, "sample"):
            from workers.cupy.gpu.kernels import DeviceDraws

            vocab = model.cfg.vocab_size
            kernels.draws = self.draws = DeviceDraws(rows, vocab)
        self._staged = None
        self._held = [None, None]  # two pinned (ids, event) pairs: a step's held draws while the next is read
        self._flip = 0

    def stage(self, rows):
        self._staged = None
        if self.draws is not None and len(rows) <= self.draws.rows:
            self.draws.load(rows)
            self._staged = rows

    def sample(self, logits, rows, index=None):
        # the staged rows stay valid until the next stage(): only it writes the parameters the kernel reads, and
        # one step may sample its rows in several calls (a verify step's plain rows, then its drafted ones)
        if self._drawn_in_step(logits, rows, index, self._staged):
            chosen = self.model.last_chosen
            sel = np.arange(len(rows)) if index is None else np.asarray(index)
            tokens = chosen.get()[sel].astype(np.int64)
            lps = [None] * len(rows)
            if rows_ask(rows, ASK_LOGPROBS):
                values = self.draws.logprob[: chosen.shape[0]].get()[sel]
                lps = [None if r.logprobs is None else [TokenLogprob(token_id=int(t), logprob=float(v))]
                       for r, t, v in zip(rows, tokens, values)]
            return tokens, lps
        return super().sample(logits, rows, index)

    def hold(self, logits, rows):
        """The step's in-step draws for the step launched after it (engine.py, overlap): the device ids as they
        are, and their copy to pinned host memory queued behind the step, with an event to wait on; None
        where the step did not draw these rows itself (the host's sampler has to see the logits)."""
        import cupy as cp

        if rows_ask(rows, ASK_LOGPROBS) or not self._drawn_in_step(logits, rows, None, self._staged):
            return None
        chosen = self.model.last_chosen
        n = int(chosen.shape[0])
        # two buffers: step k's are re-used by step k + 2, held only after step k was read
        self._flip ^= 1
        slot = self._held[self._flip]
        if slot is None or slot[0].size < n:
            mem = cp.cuda.alloc_pinned_memory(4 * max(n, 1024))
            slot = self._held[self._flip] = (np.frombuffer(mem, np.int32), cp.cuda.Event(disable_timing=True), mem)
        host, event, _ = slot
        stream = cp.cuda.get_current_stream()
        cp.ascontiguousarray(chosen).data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), 4 * n, stream)
        event.record(stream)

        def ready():
            event.synchronize()
            return host[:n].astype(np.int64), [None] * n
        return chosen, ready

    def _drawn_in_step(self, logits, rows, index, staged) -> bool:
        """Whether the step's own kernel drew exactly these rows: the very logits its forward returned, staged
        with these rows (or, on a model without device draws, greedy rows of the plain argmax), no truncation
        and no top alternatives to find."""
        chosen = getattr(self.model, "last_chosen", None)
        if chosen is None or logits is not getattr(self.model, "last_logits", None):
            return False
        if rows_ask(rows, ASK_TRUNCATED | ASK_ALTERNATIVES):
            return False
        if index is None and chosen.shape[0] != len(rows):
            return False
        if self.draws is None:
            return not rows_ask(rows, ASK_LOGPROBS) and all(r.greedy for r in rows)
        sel = range(len(rows)) if index is None else index
        return (staged is not None and len(staged) == chosen.shape[0]
                and (rows is staged or all(staged[i] is r or staged[i] == r for i, r in zip(sel, rows))))

    def choose(self, logits, rows):
        """The draw by the device kernel on (masked) logits, eagerly."""
        import cupy as cp

        from workers.cupy.gpu.kernels import DeviceDraws, argmax_chunks

        kernels = getattr(self.model, "kernels", None)
        logits = cp.ascontiguousarray(logits, dtype=cp.float32)
        s, v = logits.shape
        if kernels is None or not hasattr(kernels, "sample") or v % 4:
            return super().choose(logits, rows)
        host = np.zeros((s, 4), np.int32)
        DeviceDraws.pack(rows, host)
        host[:, 3] = 0
        n = argmax_chunks(v)
        part = [cp.empty((s, n), t) for t in (cp.float32, cp.int32, cp.float32, cp.float32)]
        out, lp = cp.empty((s,), cp.int32), cp.empty((s,), cp.float32)
        kernels.sample(logits, cp.asarray(host), out, lp, *part)
        return out.get().astype(np.int64)


def create_gpu_engine(info, weights: dict, *, block_size: int, num_blocks: int, max_num_seqs: int,
                      max_step_tokens: int, context_length: int, block_sink=None, seed: int | None = None,
                      act: str = "float16", graph_sizes=None, verify_sizes=None, window_pool: bool = True,
                      **_ignored):
    """An Engine whose model is the architecture's GPU model (models.build_gpu_model: fp16/bf16 weights, CUDA
    graphs for decode batches up to max_num_seqs). Same arguments as workers.cupy.engine.create_engine
    (`window_pool`: the sliding-window layers' own KV pool, kv_cache.plan_pools); `ops`/`dtype` are ignored.
    `graph_sizes` / `verify_sizes`: the decode and verify graphs' batch sizes (default: powers of two up to
    max_num_seqs, and verify sizes in tokens up to twice that, at least 256 and at most 512, so that a step of
    every sequence decoding plus a few short prompts replays a graph); () for none
    (`workers.engine.cuda_graphs: false`)."""
    from workers.cupy.engine import Engine
    from workers.cupy.kv_cache import BlockManager, plan_for
    from workers.cupy.models import build_gpu_model
    from workers.cupy.scheduler import Scheduler

    if graph_sizes is None:
        graph_sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s < max_num_seqs) + (max_num_seqs,)
    if verify_sizes is None:
        top = min(512, max(256, 2 * max_num_seqs))
        verify_sizes = tuple(s for s in (4, 8, 16, 32, 64, 128, 192, 256, 384, 512) if s <= top)
    model = build_gpu_model(info, weights, act=act, graph_sizes=graph_sizes, max_model_len=context_length,
                            verify_sizes=verify_sizes)
    cfg = model.cfg
    plan = plan_for(cfg, num_blocks, block_size, max_num_seqs, max_step_tokens, window_pool)
    kv = model.kv_storage(plan.num_global, block_size, num_local=plan.num_local)
    blocks = BlockManager.from_plan(plan, block_size, block_sink, info.chain_root)
    scheduler = Scheduler(blocks, max_num_seqs, max_step_tokens)
    sampler = GpuSampler(model)
    engine = Engine(model, kv, blocks, scheduler, sampler, info.eos_token_ids, context_length, info.vocab_size, seed)
    sampler.engine = engine
    return engine
