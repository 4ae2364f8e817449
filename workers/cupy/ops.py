"""The model's compute primitives, written once over the array module `xp` (NumPy or CuPy).

Architectures (gemma3.py, ...) call only these, so a GPU build replaces one primitive at a time with a
fused kernel (a subclass in workers/cupy/gpu/) without touching the model code. Shapes: T tokens of one
step flattened across sequences (varlen layout), H heads, D head dim. Activations are fp32 here; a GPU
subclass may keep bf16/fp16 and accumulate in fp32.
"""
from __future__ import annotations

import math

import numpy as np

# Cap on one attention score tile (queries x heads x keys) on the NumPy path, so a long prefill against a
# long context does not allocate gigabytes of scores at once.
_MAX_SCORE_ELEMENTS = 1 << 24


class Ops:
    weight_layout = "in_out"  # what pack_weight returns; names the derived-weight cache entries

    def __init__(self, xp):
        self.xp = xp

    # --- elementwise and dense -------------------------------------------------------------------
    def embed(self, table, token_ids, scale: float):
        return table[token_ids] * np.float32(scale)

    def rms_norm(self, x, weight, eps: float):
        """x * rsqrt(mean(x^2) + eps) * weight over the last axis (GGUF Gemma weights already hold 1 + w)."""
        xp = self.xp
        ms = xp.mean(xp.square(x), axis=-1, keepdims=True)
        return x * (1.0 / xp.sqrt(ms + np.float32(eps))) * weight

    def pack_weight(self, weight, dtype):
        """A matrix given (out, in), as GGUF stores it, in the layout `linear` wants. OpenBLAS runs the
        engine's small-M products faster on (in, out) rows (4 layer products, 1 / 8 rows: 1.5 -> 1.2 /
        5.7 -> 3.6 ms CPU time on the 2-core box)."""
        return self.xp.ascontiguousarray(self.xp.asarray(weight, dtype=dtype).T)

    def linear(self, x, weight):
        """x @ W.T for W (out, in), given `weight` = pack_weight(W)."""
        return x @ weight

    def lm_head(self, h, table):
        """Logits (rows, vocab) = h @ table.T. Written as (table @ h.T).T because OpenBLAS streams the
        262k-row table faster that way once there are several rows (8 rows: ~130 vs ~170 ms CPU time)."""
        return self.xp.ascontiguousarray((table @ h.T).T)

    def gelu_tanh_mul(self, gate, up):
        """gelu(gate, tanh approximation) * up: Gemma's gated MLP."""
        xp = self.xp
        c = np.float32(math.sqrt(2.0 / math.pi))
        g = np.float32(0.5) * gate * (1.0 + xp.tanh(c * (gate + np.float32(0.044715) * gate * gate * gate)))
        return g * up

    def silu_mul(self, gate, up):
        """silu(gate) * up: Llama's gated MLP (SwiGLU). sigmoid as 0.5 (1 + tanh(x / 2)): no exp overflow."""
        half = np.float32(0.5)
        return gate * (half + half * self.xp.tanh(half * gate)) * up

    def softcap(self, x, cap: float):
        return self.xp.tanh(x / np.float32(cap)) * np.float32(cap)

    # --- rotary embedding (NeoX layout: the two halves of each head rotate together) ---------------
    def rope_tables(self, positions, base: float, dim: int, scale: float = 1.0, freq_factors=None):
        """cos and sin, each (T, dim/2), for the step's positions; shared by every layer with this base.
        `scale` divides positions (linear scaling); `freq_factors` (dim/2,) divide each frequency (the
        `rope_freqs` tensor Llama 3.1-style GGUFs carry for their long-context scaling)."""
        xp = self.xp
        inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if freq_factors is not None:
            inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
        angles = (positions.astype(xp.float64) / scale)[:, None] * xp.asarray(inv_freq)[None, :]
        return xp.cos(angles).astype(xp.float32), xp.sin(angles).astype(xp.float32)

    def apply_rope(self, x, cos, sin):
        """x: (T, H, D). Rotates (x[..., :D/2], x[..., D/2:]) by the position's angles."""
        xp = self.xp
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    # --- paged KV cache --------------------------------------------------------------------------
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        """Store this step's keys/values (T, Hkv, D) at flat slots (block * block_size + offset)."""
        nb, bs, hkv, d = k_cache.shape
        k_cache.reshape(nb * bs, hkv, d)[slot_mapping] = k
        v_cache.reshape(nb * bs, hkv, d)[slot_mapping] = v

    def attention(self, q, k_cache, v_cache, meta, scale: float, window: int | None):
        """Causal attention of q (T, Hq, D) over each sequence's cached keys (its block table).

        `meta` (batch.AttentionMeta) gives per sequence its query rows and context length (this step's
        tokens included; their KV is already written). `window`: keys older than `window` positions
        are not seen (sliding-window layers).
        """
        out = self.xp.empty_like(q)
        n_query = np.diff(meta.query_start)
        decode = np.flatnonzero(n_query == 1)
        if decode.size:
            self._decode_attention(q, k_cache, v_cache, meta, decode, scale, window, out)
        for i in np.flatnonzero(n_query > 1):
            self._prefill_attention(q, k_cache, v_cache, meta, int(i), scale, window, out)
        return out

    def _decode_attention(self, q, k_cache, v_cache, meta, rows, scale, window, out):
        """All one-token sequences at once: keys gathered into a padded (B, Lk) batch and masked."""
        xp = self.xp
        nb, bs, hkv, d = k_cache.shape
        lens = meta.seq_lens[rows].astype(np.int64)
        start = np.maximum(lens - window, 0) if window else np.zeros_like(lens)
        first = start // bs
        n_blocks = -(-lens // bs) - first
        idx = np.minimum(first[:, None] + np.arange(n_blocks.max()), meta.block_tables.shape[1] - 1)
        blocks = meta.block_tables[rows][np.arange(rows.size)[:, None], idx]
        key_pos = first[:, None] * bs + np.arange(idx.shape[1] * bs)
        valid = (key_pos >= start[:, None]) & (key_pos < lens[:, None])
        blocks_dev, valid_dev = xp.asarray(blocks), xp.asarray(valid)
        keys = k_cache[blocks_dev].reshape(rows.size, -1, hkv, d).transpose(0, 2, 3, 1)  # (B, Hkv, D, Lk)
        values = v_cache[blocks_dev].reshape(rows.size, -1, hkv, d).transpose(0, 2, 1, 3)  # (B, Hkv, Lk, D)
        tok = xp.asarray(meta.query_start[rows])
        qr = q[tok].reshape(rows.size, hkv, -1, d)  # (B, Hkv, G, D): query heads grouped by their KV head
        scores = (qr @ keys) * np.float32(scale)
        scores = xp.where(valid_dev[:, None, None, :], scores, -xp.inf)
        out[tok] = (self._softmax(scores) @ values).reshape(rows.size, -1, d)

    def _prefill_attention(self, q, k_cache, v_cache, meta, i, scale, window, out):
        """One sequence's chunk of queries against its context, in tiles of queries."""
        xp = self.xp
        nb, bs, hkv, d = k_cache.shape
        q0, q1 = int(meta.query_start[i]), int(meta.query_start[i + 1])
        length, n = int(meta.seq_lens[i]), q1 - q0
        start = max(0, length - n - window + 1) if window else 0
        first, last = start // bs, -(-length // bs)
        blocks = xp.asarray(meta.block_tables[i, first:last])
        keys = k_cache[blocks].reshape(-1, hkv, d)[: length - first * bs]
        values = v_cache[blocks].reshape(-1, hkv, d)[: length - first * bs]
        keys_t, values_t = keys.transpose(1, 2, 0), values.transpose(1, 0, 2)  # (Hkv, D, Lk), (Hkv, Lk, D)
        key_pos = np.arange(first * bs, length)
        group = q.shape[1] // hkv
        tile = max(1, _MAX_SCORE_ELEMENTS // (q.shape[1] * key_pos.size))
        for t0 in range(0, n, tile):
            t1 = min(n, t0 + tile)
            q_pos = np.arange(length - n + t0, length - n + t1)
            mask = key_pos[None, :] <= q_pos[:, None]
            if window:
                mask &= q_pos[:, None] - key_pos[None, :] < window
            qt = q[q0 + t0 : q0 + t1].reshape(t1 - t0, hkv, group, d).transpose(1, 0, 2, 3)
            scores = (qt.reshape(hkv, -1, d) @ keys_t).reshape(hkv, t1 - t0, group, -1) * np.float32(scale)
            scores = xp.where(xp.asarray(mask)[None, :, None, :], scores, -xp.inf)
            probs = self._softmax(scores).reshape(hkv, (t1 - t0) * group, -1)
            o = (probs @ values_t).reshape(hkv, t1 - t0, group, d).transpose(1, 0, 2, 3)
            out[q0 + t0 : q0 + t1] = o.reshape(t1 - t0, -1, d)

    def _softmax(self, x):
        xp = self.xp
        e = xp.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
