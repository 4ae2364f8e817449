"""The engine's NumPy primitives against plain dense formulas (no paging, no tiling)."""
import math

import numpy as np
import pytest

from workers.cupy.batch import AttentionMeta
from workers.cupy.ops import Ops

ops = Ops(np)


def dense_attention(q, k, v, q_pos, scale, window):
    """q (n, Hq, D) at positions q_pos over k, v (L, Hkv, D) at positions 0..L-1."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros_like(q)
    for t in range(n):
        for h in range(hq):
            s = k[:, h // group] @ q[t, h] * scale
            pos = np.arange(k.shape[0])
            ok = (pos <= q_pos[t]) & ((q_pos[t] - pos < window) if window else True)
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:, h // group]
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense_for_mixed_prefill_and_decode(window):
    rng = np.random.default_rng(0)
    bs, hq, hkv, d, num_blocks = 4, 4, 2, 8, 32
    k_cache = np.zeros((num_blocks, bs, hkv, d), np.float32)
    v_cache = np.zeros_like(k_cache)
    # three sequences: a 9-token prefill from scratch, a decode at length 13, a 3-token chunk after 6 cached
    shapes = [(0, 9), (12, 1), (6, 3)]
    free = list(rng.permutation(num_blocks))
    tables, qs, ks, vs, q_all, lens, slots, q_pos_all = [], [0], [], [], [], [], [], []
    for cached, n in shapes:
        length = cached + n
        table = [int(free.pop()) for _ in range(-(-length // bs))]
        k = rng.standard_normal((length, hkv, d)).astype(np.float32)
        v = rng.standard_normal((length, hkv, d)).astype(np.float32)
        pos = np.arange(length)
        flat = np.asarray(table)[pos // bs] * bs + pos % bs
        ops.write_kv(k_cache, v_cache, k, v, flat)
        tables.append(table), ks.append(k), vs.append(v), lens.append(length)
        q_all.append(rng.standard_normal((n, hq, d)).astype(np.float32))
        qs.append(qs[-1] + n)
    width = max(map(len, tables))
    meta = AttentionMeta(
        query_start=np.asarray(qs, np.int32), seq_lens=np.asarray(lens, np.int32),
        block_tables=np.asarray([t + [0] * (width - len(t)) for t in tables], np.int32), block_size=bs,
    )
    got = ops.attention(np.concatenate(q_all), k_cache, v_cache, meta, 1 / math.sqrt(d), window)
    for i, (cached, n) in enumerate(shapes):
        want = dense_attention(q_all[i], ks[i], vs[i], np.arange(cached, cached + n), 1 / math.sqrt(d), window)
        np.testing.assert_allclose(got[qs[i] : qs[i + 1]], want, rtol=1e-5, atol=1e-5)


def test_rope_rotates_halves_and_preserves_norm():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    pos = np.array([0, 1, 7], np.int32)
    cos, sin = ops.rope_tables(pos, 10_000.0, 8)
    y = ops.apply_rope(x, cos, sin)
    np.testing.assert_allclose(y[0], x[0], atol=1e-6)  # position 0: no rotation
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    theta = 1 * 10_000.0 ** (-2 * 1 / 8)  # position 1, frequency pair 1: (x[1], x[5]) rotate by theta
    a, b = x[1, 0, 1], x[1, 0, 5]
    np.testing.assert_allclose(y[1, 0, [1, 5]], [a * math.cos(theta) - b * math.sin(theta),
                                                 b * math.cos(theta) + a * math.sin(theta)], rtol=1e-5)


def test_rms_norm_and_gelu_follow_their_formulas():
    x = np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)
    w = np.array([1.0, 2.0, 0.5, 1.0], np.float32)
    rms = math.sqrt((1 + 4 + 9 + 0.25) / 4 + 1e-6)
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6), x / rms * w, rtol=1e-6)
    g = np.array([-1.0, 0.0, 2.0], np.float32)
    want = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    np.testing.assert_allclose(ops.gelu_tanh_mul(g, np.ones(3, np.float32)), want, rtol=1e-6)
