"""Llama-family decoders (Llama 2/3, SmolLM, TinyLlama, ...), as llama.cpp writes them to GGUF.

Per layer: RMSNorm -> q/k/v (one fused product) -> RoPE -> grouped-query attention -> output product ->
residual; then RMSNorm -> silu(gate) * up -> down -> residual. The output head is `output.weight`, or the
token embeddings when the file has none (tied).

llama.cpp's converter permutes the rows of q and k within each head so that its RoPE rotates adjacent pairs
(x[2i], x[2i+1]). Un-permuting them at load gives the split-halves layout ops.apply_rope (and the GPU
kernels) rotate; q.k is unchanged by a permutation applied to both, so the model computes the same function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workers.cupy.batch import StepBatch
from workers.cupy.kv_cache import KVStorage
from workers.cupy.ops import Ops


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    eps: float
    rope_base: float = 10_000.0
    rope_scale: float = 1.0  # linear RoPE scaling: positions divided by this
    window: None = None  # every layer attends to the whole context (kv_cache.plan_for reads this)

    @property
    def query_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hparams(cls, hp: dict, vocab_size: int) -> LlamaConfig:
        a = "llama."
        hidden, n_heads = int(hp[a + "embedding_length"]), int(hp[a + "attention.head_count"])
        head_dim = int(hp.get(a + "attention.key_length", hidden // n_heads))
        rot = int(hp.get(a + "rope.dimension_count", head_dim))
        if rot != head_dim:
            raise ValueError(f"llama GGUF rotates {rot} of {head_dim} head dims: partial RoPE is not supported")
        return cls(
            n_layers=int(hp[a + "block_count"]),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(hp.get(a + "attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn=int(hp[a + "feed_forward_length"]),
            vocab_size=vocab_size,
            eps=float(hp.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(hp.get(a + "rope.freq_base", 10_000.0)),
            rope_scale=_linear_rope_scale(hp, a),
        )

    def is_global(self, layer: int) -> bool:
        return True


def _linear_rope_scale(hp: dict, a: str) -> float:
    """The linear position scaling the header declares (1.0: none). Other schemes (YaRN, LongRoPE) are
    refused rather than run wrong; Llama 3.1's scaling comes as the `rope_freqs` tensor instead."""
    kind = str(hp.get(a + "rope.scaling.type", "none") or "none")
    factor = float(hp.get(a + "rope.scaling.factor", 0.0) or hp.get(a + "rope.scale_linear", 0.0) or 1.0)
    if kind not in ("none", "linear") and factor != 1.0:
        raise ValueError(f"llama GGUF declares RoPE scaling {kind!r}: the engine runs linear scaling only")
    return factor


def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's q/k row permutation (adjacent rotation pairs -> the two halves of each head)."""
    w = np.asarray(w)
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class Llama:
    architecture = "llama"

    def __init__(self, cfg: LlamaConfig, weights: dict, ops: Ops, dtype: str = "float32"):
        self.cfg, self.ops, self.xp = cfg, ops, ops.xp
        xp = ops.xp
        self.embed = xp.asarray(weights["token_embd.weight"], dtype=dtype)
        # untied head: its own (vocab, hidden) table; tied: the embeddings (no second copy)
        head = weights.get("output.weight")
        self.head = self.embed if head is None else xp.asarray(head, dtype=dtype)
        freqs = weights.get("rope_freqs.weight")
        self.freq_factors = None if freqs is None else np.asarray(freqs, dtype=np.float64)
        self.out_norm = xp.asarray(weights["output_norm.weight"], dtype=dtype)
        self.layers = [self._layer_weights(weights, i, dtype) for i in range(cfg.n_layers)]

    def _layer_weights(self, w: dict, i: int, dtype: str) -> dict:
        xp, p, c = self.xp, f"blk.{i}.", self.cfg

        def matrix(key: str, parts):  # one product for several matrices (q, k, v; gate, up): fewer, larger GEMMs
            def build():
                return self.ops.pack_weight(np.concatenate([f() for f in parts]), dtype)

            if xp is np and hasattr(w, "derived"):  # host arrays: one shared, memory-mapped copy per box
                return w.derived(f"{p}{key}.{self.ops.weight_layout}.{dtype}", build)
            return build()

        def t(name):
            return lambda: w[p + name + ".weight"]

        return {
            "attn_norm": xp.asarray(w[p + "attn_norm.weight"], dtype=dtype),
            "qkv": matrix("attn_q-halves+attn_k-halves+attn_v", [
                lambda: unpermute_rope_rows(w[p + "attn_q.weight"], c.n_heads),
                lambda: unpermute_rope_rows(w[p + "attn_k.weight"], c.n_kv_heads), t("attn_v")]),
            "o": matrix("attn_output", [t("attn_output")]),
            "ffn_norm": xp.asarray(w[p + "ffn_norm.weight"], dtype=dtype),
            "gate_up": matrix("ffn_gate+ffn_up", [t("ffn_gate"), t("ffn_up")]),
            "down": matrix("ffn_down", [t("ffn_down")]),
        }

    def kv_storage(self, num_blocks: int, block_size: int, dtype: str = "float32",
                   num_local: int | None = None) -> KVStorage:
        """One pool for every layer (no sliding-window layers: `num_local` is always None here)."""
        c = self.cfg
        return KVStorage(self.xp, c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, dtype)

    def forward(self, batch: StepBatch, kv: KVStorage):
        """Logits (rows of batch.logits_indices, vocab) for one step; writes the step's K/V into `kv`."""
        c, ops = self.cfg, self.ops
        x = ops.embed(self.embed, batch.token_ids, 1.0)
        rope = ops.rope_tables(batch.positions, c.rope_base, c.head_dim, c.rope_scale, self.freq_factors)
        for i, lw in enumerate(self.layers):
            x = self._layer(i, lw, x, batch, kv, rope)
        h = ops.rms_norm(x[batch.logits_indices], self.out_norm, c.eps)
        return ops.lm_head(h, self.head)

    def _layer(self, i: int, lw: dict, x, batch: StepBatch, kv: KVStorage, rope):
        c, ops = self.cfg, self.ops
        t = x.shape[0]
        qkv = ops.linear(ops.rms_norm(x, lw["attn_norm"], c.eps), lw["qkv"])
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = ops.apply_rope(qkv[:, :nq].reshape(t, c.n_heads, c.head_dim), *rope)
        k = ops.apply_rope(qkv[:, nq : nq + nk].reshape(t, c.n_kv_heads, c.head_dim), *rope)
        v = qkv[:, nq + nk :].reshape(t, c.n_kv_heads, c.head_dim)
        slots, meta = batch.kv_args(True)
        ops.write_kv(kv.k[i], kv.v[i], k, v, slots)
        attn = ops.attention(q, kv.k[i], kv.v[i], meta, c.query_scale, None)
        x = x + ops.linear(attn.reshape(t, nq), lw["o"])
        gate_up = ops.linear(ops.rms_norm(x, lw["ffn_norm"], c.eps), lw["gate_up"])
        return x + ops.linear(ops.silu_mul(gate_up[:, : c.ffn], gate_up[:, c.ffn :]), lw["down"])
