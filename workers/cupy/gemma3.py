"""Gemma 3 (text), as llama.cpp writes it to GGUF: the forward pass over a paged KV cache.

Per layer: RMSNorm -> q/k/v (one fused product) -> per-head RMSNorm on q and k (QK-norm) -> RoPE ->
attention (sliding window of `window` tokens on local layers; every `swa_pattern`-th layer is global)
-> output product -> post-attention RMSNorm -> residual; then RMSNorm -> gelu-tanh(gate) * up -> down ->
post-FFN RMSNorm -> residual. Embeddings are scaled by sqrt(hidden) and tied to the output head.

llama.cpp's converter stores Gemma's RMSNorm weights with the +1 already added (the checkpoint holds w
for x * (1 + w)); tests/integration/test_engine_reference.py checks the logits against transformers,
which reads the same file its own way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workers.cupy.batch import StepBatch
from workers.cupy.kv_cache import KVStorage
from workers.cupy.ops import Ops


@dataclass(frozen=True)
class Gemma3Config:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    eps: float
    rope_base_global: float
    rope_base_local: float = 10_000.0  # not in the GGUF header; llama.cpp fixes it for Gemma 3
    rope_scale_global: float = 1.0  # linear RoPE scaling of the global layers (larger Gemma 3 models)
    window: int = 512
    swa_pattern: int = 6  # layers 5, 11, 17, ... are global
    final_softcap: float | None = None
    query_scale: float = 0.0

    @classmethod
    def from_hparams(cls, hp: dict, vocab_size: int) -> Gemma3Config:
        a = "gemma3."
        head_dim = int(hp.get(a + "attention.key_length", 256))
        return cls(
            n_layers=int(hp[a + "block_count"]),
            hidden=int(hp[a + "embedding_length"]),
            n_heads=int(hp[a + "attention.head_count"]),
            n_kv_heads=int(hp.get(a + "attention.head_count_kv", 1)),
            head_dim=head_dim,
            ffn=int(hp[a + "feed_forward_length"]),
            vocab_size=vocab_size,
            eps=float(hp.get(a + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base_global=float(hp.get(a + "rope.freq_base", 1_000_000.0)),
            rope_scale_global=float(hp.get(a + "rope.scaling.factor", 1.0) or 1.0),
            window=int(hp.get(a + "attention.sliding_window", 512)),
            final_softcap=hp.get(a + "final_logit_softcapping"),
            # llama.cpp: 1/sqrt(head_dim) for every size but 27B, which uses 1/sqrt(hidden / heads)
            query_scale=1.0 / math.sqrt(head_dim),
        )

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.swa_pattern == 0


class Gemma3:
    architecture = "gemma3"

    def __init__(self, cfg: Gemma3Config, weights: dict, ops: Ops, dtype: str = "float32"):
        self.cfg, self.ops, self.xp = cfg, ops, ops.xp
        xp = ops.xp
        self.embed = xp.asarray(weights["token_embd.weight"], dtype=dtype)
        self.out_norm = xp.asarray(weights["output_norm.weight"], dtype=dtype)
        self.layers = [self._layer_weights(weights, i, dtype) for i in range(cfg.n_layers)]

    def _layer_weights(self, w: dict, i: int, dtype: str) -> dict:
        xp, p = self.xp, f"blk.{i}."

        def get(name):
            return xp.asarray(w[p + name + ".weight"], dtype=dtype)

        def matrix(*names):  # one product for several matrices (q, k, v; gate, up): fewer, larger GEMMs
            def build():
                return self.ops.pack_weight(np.concatenate([w[p + n + ".weight"] for n in names]), dtype)

            if xp is np and hasattr(w, "derived"):  # host arrays: one shared, memory-mapped copy per box
                return w.derived(f"{p}{'+'.join(names)}.{self.ops.weight_layout}.{dtype}", build)
            return build()

        return {
            "attn_norm": get("attn_norm"), "qkv": matrix("attn_q", "attn_k", "attn_v"),
            "q_norm": get("attn_q_norm"), "k_norm": get("attn_k_norm"), "o": matrix("attn_output"),
            "post_attn_norm": get("post_attention_norm"), "ffn_norm": get("ffn_norm"),
            "gate_up": matrix("ffn_gate", "ffn_up"), "down": matrix("ffn_down"),
            "post_ffn_norm": get("post_ffw_norm"),
        }

    def kv_storage(self, num_blocks: int, block_size: int, dtype: str = "float32",
                   num_local: int | None = None) -> KVStorage:
        """num_local None: one pool for every layer; else the sliding-window layers' own pool (kv_cache.py)."""
        c = self.cfg
        return KVStorage(self.xp, c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, dtype,
                         is_global=[c.is_global(i) for i in range(c.n_layers)], num_local=num_local)

    def forward(self, batch: StepBatch, kv: KVStorage):
        """Logits (rows of batch.logits_indices, vocab) for one step; writes the step's K/V into `kv`."""
        c, ops = self.cfg, self.ops
        x = ops.embed(self.embed, batch.token_ids, math.sqrt(c.hidden))
        rope_local = ops.rope_tables(batch.positions, c.rope_base_local, c.head_dim)
        rope_global = ops.rope_tables(batch.positions, c.rope_base_global, c.head_dim, c.rope_scale_global)
        for i, lw in enumerate(self.layers):
            is_global = c.is_global(i)
            x = self._layer(i, lw, x, batch, kv, rope_global if is_global else rope_local, is_global)
        h = ops.rms_norm(x[batch.logits_indices], self.out_norm, c.eps)
        logits = ops.lm_head(h, self.embed)
        return ops.softcap(logits, c.final_softcap) if c.final_softcap else logits

    def _layer(self, i: int, lw: dict, x, batch: StepBatch, kv: KVStorage, rope, is_global: bool):
        c, ops = self.cfg, self.ops
        t = x.shape[0]
        qkv = ops.linear(ops.rms_norm(x, lw["attn_norm"], c.eps), lw["qkv"])
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = ops.rms_norm(qkv[:, :nq].reshape(t, c.n_heads, c.head_dim), lw["q_norm"], c.eps)
        k = ops.rms_norm(qkv[:, nq : nq + nk].reshape(t, c.n_kv_heads, c.head_dim), lw["k_norm"], c.eps)
        v = qkv[:, nq + nk :].reshape(t, c.n_kv_heads, c.head_dim)
        q, k = ops.apply_rope(q, *rope), ops.apply_rope(k, *rope)
        slots, meta = batch.kv_args(is_global)  # sliding-window layers may have their own pool's blocks
        ops.write_kv(kv.k[i], kv.v[i], k, v, slots)
        window = None if is_global else c.window
        attn = ops.attention(q, kv.k[i], kv.v[i], meta, c.query_scale, window)
        x = x + ops.rms_norm(ops.linear(attn.reshape(t, nq), lw["o"]), lw["post_attn_norm"], c.eps)
        gate_up = ops.linear(ops.rms_norm(x, lw["ffn_norm"], c.eps), lw["gate_up"])
        mlp = ops.gelu_tanh_mul(gate_up[:, : c.ffn], gate_up[:, c.ffn :])
        return x + ops.rms_norm(ops.linear(mlp, lw["down"]), lw["post_ffn_norm"], c.eps)
