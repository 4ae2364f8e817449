"""What one stage computes: a contiguous range of Gemma 3 layers, its own KV for them, and (in the driver)
the ends: embeddings in, final norm and output head out.

Both paths reuse the single-stage model classes over a renumbered slice of the weights, so a stage runs the
very code (and, on a GPU, the very kernels) the single-stage engine runs: greedy output is the same.
- NumPy: workers/cupy/gemma3.Gemma3 (its `_layer`), run per layer.
- GPU: workers/cupy/gpu/gemma3.GpuGemma3's kernels on its general (cuBLAS) path, eagerly: a stage's
  input arrives from the network, so its steps are not captured as CUDA graphs (one is, single-stage).
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from workers.cupy.batch import AttentionMeta, StepBatch
from workers.cupy.gemma3 import Gemma3Config

_BLK = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class RangeConfig(Gemma3Config):
    """Gemma3Config for layers [first_layer, first_layer + n_layers): sliding-window vs global by the
    layer's place in the whole model, not in the slice."""

    first_layer: int = 0

    def is_global(self, layer: int) -> bool:
        return super().is_global(layer + self.first_layer)


def range_config(cfg: Gemma3Config, lo: int, hi: int) -> RangeConfig:
    return RangeConfig(**{**dataclasses.asdict(cfg), "n_layers": hi - lo, "first_layer": lo})


def slice_weights(weights: dict, lo: int, hi: int, hidden: int, ends: bool) -> dict:
    """Layers lo..hi-1 renamed blk.0.. ; the embedding table only when `ends` (the driver), else a one-row
    placeholder the model classes' constructors read but a stage never uses (it is 335 MB at fp16)."""
    out = {}
    for name, w in weights.items():
        m = _BLK.fullmatch(name)
        if m and lo <= int(m.group(1)) < hi:
            out[f"blk.{int(m.group(1)) - lo}.{m.group(2)}"] = w
    out["output_norm.weight"] = weights["output_norm.weight"]
    out["token_embd.weight"] = weights["token_embd.weight"] if ends else np.zeros((1, hidden), np.float32)
    return out


def stage_batch(a: dict, block_size: int) -> StepBatch:
    """The layers' view of a step rebuilt from the arrays a message carries (no token ids: they stay with
    the driver)."""
    meta = AttentionMeta(a["query_start"], a["seq_lens"], a["block_tables"], block_size)
    local = {}
    if "local_block_tables" in a:
        local = {"local_slot_mapping": a["local_slot_mapping"],
                 "local_meta": AttentionMeta(a["query_start"], a["seq_lens"], a["local_block_tables"], block_size)}
    return StepBatch(None, a["positions"], a["slot_mapping"], a["logits_indices"], meta, [],
                     int(a["query_start"][-1]), **local)


class NumpyLayers:
    """Layers on the NumPy path; KV (only these layers) in the stage's memory."""

    def __init__(self, cfg: Gemma3Config, weights: dict, lo: int, hi: int, dtype: str = "float32"):
        from workers.cupy.gemma3 import Gemma3
        from workers.cupy.ops import Ops

        self.model = Gemma3(range_config(cfg, lo, hi), slice_weights(weights, lo, hi, cfg.hidden, False),
                            Ops(np), dtype)
        self.dtype, self.kv = dtype, None

    def alloc_kv(self, num_blocks: int, block_size: int, max_seqs: int = 0, num_local: int | None = None) -> None:
        self.kv = self.model.kv_storage(num_blocks, block_size, self.dtype, num_local=num_local)

    def run(self, x: np.ndarray, batch: StepBatch, last: bool) -> np.ndarray:
        m, c, ops = self.model, self.model.cfg, self.model.ops
        rope_local = ops.rope_tables(batch.positions, c.rope_base_local, c.head_dim)
        rope_global = ops.rope_tables(batch.positions, c.rope_base_global, c.head_dim, c.rope_scale_global)
        for i, lw in enumerate(m.layers):
            g = c.is_global(i)
            x = m._layer(i, lw, x, batch, self.kv, rope_global if g else rope_local, g)
        return x[batch.logits_indices] if last else x


class NumpyEnds:
    """The driver's part on the NumPy path: embeddings, final norm, tied output head."""

    xp = np

    def __init__(self, cfg: Gemma3Config, weights: dict, dtype: str = "float32"):
        from workers.cupy.ops import Ops

        self.cfg, self.ops = cfg, Ops(np)
        self.embed = np.asarray(weights["token_embd.weight"], dtype=dtype)
        self.out_norm = np.asarray(weights["output_norm.weight"], dtype=dtype)

    def embed_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        return self.ops.embed(self.embed, token_ids, math.sqrt(self.cfg.hidden))

    def head(self, x_rows: np.ndarray):
        c, ops = self.cfg, self.ops
        logits = ops.lm_head(ops.rms_norm(x_rows, self.out_norm, c.eps), self.embed)
        return ops.softcap(logits, c.final_softcap) if c.final_softcap else logits
