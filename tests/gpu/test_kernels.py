"""Each fused kernel and the ctypes cuBLAS GEMM against the NumPy engine's own primitives (workers/cupy/ops.py).

Fresh random inputs each run, outputs poisoned with NaN first so an unwritten element fails, relative errors
against fp64/fp32 references at fp16 tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest

from workers.cupy.batch import AttentionMeta
from workers.cupy.ops import Ops

cp = pytest.importorskip("cupy")

from workers.cupy.gpu.cublas import Cublas  # noqa: E402
from workers.cupy.gpu.kernels import Kernels  # noqa: E402

RNG = np.random.default_rng()
OPS = Ops(np)
H, HD, NH, NKV, EPS = 640, 256, 4, 1, 1e-6


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output (unwritten or overflowed)"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def k():
    return Kernels(HD, NH // NKV, "float16")


def test_embed_norm(k):
    t, v = 7, 1000
    emb = RNG.standard_normal((v, H)).astype(np.float16)
    tok = RNG.integers(0, v, t).astype(np.int32)
    w = RNG.standard_normal(H).astype(np.float32)
    resid = cp.full((t, H), np.nan, cp.float32)
    out = cp.full((t, H), np.nan, cp.float16)
    k.embed_norm(cp.asarray(tok), cp.asarray(emb), np.sqrt(H), cp.asarray(w), EPS, resid, out)
    ref = OPS.embed(emb.astype(np.float32), tok, np.sqrt(H))
    assert rel(resid.get(), ref) < 1e-6
    assert rel(out.get(), OPS.rms_norm(ref, w, EPS)) < 2e-3


@pytest.mark.parametrize("rows", [None, [3, 0]])
def test_add_norm(k, rows):
    t = 5
    resid0 = (RNG.standard_normal((t, H)) * 50).astype(np.float32)  # Gemma's residual is large
    delta = RNG.standard_normal((t, H)).astype(np.float32)
    w_post, w_next = (RNG.standard_normal(H).astype(np.float32) for _ in range(2))
    resid = cp.asarray(resid0)
    n = t if rows is None else len(rows)
    out = cp.full((n, H), np.nan, cp.float16)
    k.add_norm(resid, cp.asarray(delta), cp.asarray(w_post), cp.asarray(w_next), EPS, out,
               rows=None if rows is None else cp.asarray(np.array(rows, np.int64)))
    new = resid0 + OPS.rms_norm(delta, w_post, EPS)
    sel = slice(None) if rows is None else rows
    assert rel(out.get(), OPS.rms_norm(new, w_next, EPS)[sel]) < 2e-3
    assert rel(resid.get(), new if rows is None else resid0) < 1e-6


def test_qkv_post(k):
    t, nb, bs = 6, 8, 16
    qkv = (RNG.standard_normal((t, (NH + 2 * NKV) * HD)) * 3).astype(np.float32)
    qn, kn = (RNG.standard_normal(HD).astype(np.float32) for _ in range(2))
    pos = RNG.integers(0, 30000, t).astype(np.int32)
    slots = RNG.permutation(nb * bs)[:t].astype(np.int64)
    q_out = cp.full((t, NH * HD), np.nan, cp.float16)
    kc = cp.zeros((nb, bs, NKV, HD), cp.float16)
    vc = cp.zeros((nb, bs, NKV, HD), cp.float16)
    table = [cp.asarray(a) for a in OPS.rope_tables(np.arange(30000), 1e6, HD)]
    k.qkv_post(cp.asarray(qkv), cp.asarray(qn), cp.asarray(kn), cp.asarray(pos), cp.asarray(slots), *table, EPS,
               NH, NKV, q_out, kc, vc)
    cos, sin = OPS.rope_tables(pos, 1e6, HD)
    q = OPS.apply_rope(OPS.rms_norm(qkv[:, : NH * HD].reshape(t, NH, HD), qn, EPS), cos, sin)
    kk = OPS.apply_rope(OPS.rms_norm(qkv[:, NH * HD : (NH + NKV) * HD].reshape(t, NKV, HD), kn, EPS), cos, sin)
    v = qkv[:, (NH + NKV) * HD :].reshape(t, NKV, HD)
    assert rel(q_out.get().reshape(t, NH, HD), q) < 2e-3
    assert rel(kc.get().reshape(-1, NKV, HD)[slots], kk) < 2e-3
    assert rel(vc.get().reshape(-1, NKV, HD)[slots], v) < 2e-3


@pytest.mark.parametrize("window", [None, 512])
def test_attention_mixed_step(k, window):
    """One step with a prefill chunk (on top of a cached prefix) and decode tokens of several lengths."""
    bs, nb = 16, 160
    # (context length after the step, new tokens this step)
    seqs = [(140, 40), (1, 1), (300, 1), (777, 1), (600, 70)]
    perm = RNG.permutation(nb)
    tables, used = np.zeros((len(seqs), 64), np.int32), 0
    for b, (length, _) in enumerate(seqs):
        n = -(-length // bs)
        tables[b, :n] = perm[used : used + n]
        used += n
    kc = (RNG.standard_normal((nb, bs, NKV, HD))).astype(np.float16)
    vc = (RNG.standard_normal((nb, bs, NKV, HD))).astype(np.float16)
    n_query = np.array([n for _, n in seqs])
    qs = np.concatenate([[0], np.cumsum(n_query)]).astype(np.int32)
    lens = np.array([length for length, _ in seqs], np.int32)
    t = int(qs[-1])
    q = (RNG.standard_normal((t, NH, HD)) * 2).astype(np.float16)
    pos = np.concatenate([np.arange(length - n, length) for length, n in seqs]).astype(np.int32)
    tok_row = np.repeat(np.arange(len(seqs)), n_query).astype(np.int32)
    out = cp.full((t, NH * HD), np.nan, cp.float16)
    k.attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cp.asarray(tables), cp.asarray(tok_row),
                cp.asarray(pos), bs, window or 0, 1 / 16, NKV, out)
    meta = AttentionMeta(qs, lens, tables, bs)
    ref = OPS.attention(q.astype(np.float32), kc.astype(np.float32), vc.astype(np.float32), meta, 1 / 16, window)
    assert rel(out.get().reshape(t, NH, HD), ref) < 3e-3


def test_gelu_mul(k):
    t, f = 9, 2048
    gu = (RNG.standard_normal((t, 2 * f)) * 3).astype(np.float32)
    out = cp.full((t, f), np.nan, cp.float16)
    k.gelu_mul(cp.asarray(gu), out)
    assert rel(out.get(), OPS.gelu_tanh_mul(gu[:, :f], gu[:, f:])) < 2e-3


@pytest.mark.parametrize("two_stage", [False, True])
def test_argmax_rows_first_max(k, two_stage):
    s, v = 5, 262_144
    logits = RNG.standard_normal((s, v)).astype(np.float32)
    logits[2, [17, 200_000]] = 100.0
    logits[3, [4095, 4096, 8191]] = 100.0  # ties across stage-1 blocks  # a tie: the first index wins, as in np.argmax
    out = cp.full(s, -1, cp.int32)
    scratch = [cp.empty((s, 64), cp.float32), cp.empty((s, 64), cp.int32)] if two_stage else [None, None]
    k.argmax_rows(cp.asarray(logits), out, *scratch)
    assert out.get().tolist() == np.argmax(logits, axis=1).tolist()


@pytest.mark.parametrize("m", [1, 7, 64, 512])
def test_cublas_linear_eager_and_in_graph(m):
    blas = Cublas("float16")
    n, kdim = 1536, 640
    x = RNG.standard_normal((m, kdim)).astype(np.float16)
    w = (RNG.standard_normal((n, kdim)) * 0.05).astype(np.float16)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    xd, wd = cp.asarray(x), cp.asarray(w)
    out = cp.full((m, n), np.nan, cp.float32)
    blas.linear(xd, wd, out)
    assert rel(out.get(), ref) < 1e-3
    # the same call captured in a CUDA graph (CuPy's own cuBLAS path refuses this), then replayed
    out2 = cp.full((m, n), np.nan, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        blas.linear(xd, wd, out2)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert rel(out2.get(), ref) < 1e-3


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("mode", ["plain", "add_norm", "gelu", "embed"])
def test_gemv_prologues(k, m, mode):
    from workers.cupy.gpu.kernels import GEMV_ADD_NORM, GEMV_EMBED, GEMV_GELU, GEMV_PLAIN

    kdim = 2048 if mode == "gelu" else 640
    n = 1536 + 8  # not a multiple of the 16 rows a block computes
    w = (RNG.standard_normal((n, kdim)) / np.sqrt(kdim)).astype(np.float16)
    w_post, w_norm = (1 + RNG.standard_normal(kdim).astype(np.float32) * 0.1 for _ in range(2))
    out = cp.full((m, n), np.nan, cp.float32)
    resid_out = cp.full((m, kdim), np.nan, cp.float32)
    if mode == "plain":
        x = RNG.standard_normal((m, kdim)).astype(np.float16)
        k.gemv(GEMV_PLAIN, cp.asarray(w), out, x_act=cp.asarray(x))
        xref = x.astype(np.float32)
    elif mode == "gelu":
        gu = (RNG.standard_normal((m, 2 * kdim)) * 2).astype(np.float32)
        k.gemv(GEMV_GELU, cp.asarray(w), out, src=cp.asarray(gu))
        xref = OPS.gelu_tanh_mul(gu[:, :kdim], gu[:, kdim:])
    elif mode == "add_norm":
        r = (RNG.standard_normal((m, kdim)) * 30).astype(np.float32)  # noqa: E501
        d = RNG.standard_normal((m, kdim)).astype(np.float32)
        k.gemv(GEMV_ADD_NORM, cp.asarray(w), out, src=cp.asarray(d), resid_in=cp.asarray(r), resid_out=resid_out,
               w_post=cp.asarray(w_post), w_norm=cp.asarray(w_norm), eps=EPS)
        new = r + OPS.rms_norm(d, w_post, EPS)
        xref = OPS.rms_norm(new, w_norm, EPS)
        assert rel(resid_out.get(), new) < 1e-6
    else:
        emb = RNG.standard_normal((500, kdim)).astype(np.float16)
        tok = RNG.integers(0, 500, m).astype(np.int32)
        k.gemv(GEMV_EMBED, cp.asarray(w), out, tok=cp.asarray(tok), emb=cp.asarray(emb), emb_scale=np.sqrt(kdim),
               w_norm=cp.asarray(w_norm), resid_out=resid_out, eps=EPS)
        e = OPS.embed(emb.astype(np.float32), tok, np.sqrt(kdim))
        xref = OPS.rms_norm(e, w_norm, EPS)
        assert rel(resid_out.get(), e) < 1e-6
    assert rel(out.get(), xref.astype(np.float64) @ w.astype(np.float64).T) < 1e-3


@pytest.mark.parametrize("n_split", [1, 3, 8])
def test_attention_fused_decode_equals_separate(k, n_split):
    """A decode step's fused attention (QK-norm, RoPE, KV write inside) matches qkv_post + attention."""
    bs, nb, b = 16, 64, 5
    lens = np.array([1, 17, 100, 513, 700], np.int32)  # context after the step, this token included
    nb = 5 * 48
    tables = RNG.permutation(nb).reshape(b, 48).astype(np.int32)
    pos = (lens - 1).astype(np.int32)
    slots = (tables[np.arange(b), pos // bs].astype(np.int64) * bs + pos % bs)
    qkv = (RNG.standard_normal((b, (NH + 2 * NKV) * HD)) * 2).astype(np.float32)
    qn, kn = (1 + RNG.standard_normal(HD).astype(np.float32) * 0.1 for _ in range(2))
    base_k = RNG.standard_normal((nb, bs, NKV, HD)).astype(np.float16)
    base_v = RNG.standard_normal((nb, bs, NKV, HD)).astype(np.float16)
    rows = cp.arange(b, dtype=cp.int32)
    rc, rs = (cp.asarray(a) for a in OPS.rope_tables(np.arange(1024), 1e4, HD))
    args = [cp.asarray(a) for a in (tables,)] + [rows, cp.asarray(pos)]
    outs, caches = [], []
    for fused in (False, True):
        kc, vc = cp.asarray(base_k), cp.asarray(base_v)
        out = cp.full((b, NH * HD), np.nan, cp.float16)
        q = cp.full((b, NH * HD), np.nan, cp.float16)
        d_qkv, d_qn, d_kn, d_slots = cp.asarray(qkv), cp.asarray(qn), cp.asarray(kn), cp.asarray(slots)
        if not fused:
            k.qkv_post(d_qkv, d_qn, d_kn, cp.asarray(pos), d_slots, rc, rs, EPS, NH, NKV, q, kc, vc)
        split = dict(n_split=n_split, part=cp.full((b, 8, NH * HD + 2 * NH), np.nan, cp.float32),
                     counter=cp.zeros(b, cp.uint32)) if fused else {}
        k.attention(None if fused else q, kc, vc, *args, bs, 512, 1 / 16, NKV, out,
                    fused=(d_qkv, d_qn, d_kn, d_slots, rc, rs, EPS) if fused else None, **split)
        if fused and n_split > 1:
            assert not split["counter"].get().any()  # the merging block reset every count
        outs.append(out.get())
        caches.append((kc.get(), vc.get()))
    assert rel(outs[1], outs[0]) < 2e-3
    assert np.array_equal(caches[1][1], caches[0][1])
    assert rel(caches[1][0], caches[0][0]) < 1e-3


@pytest.mark.parametrize("m", [1, 5, 8])
def test_mlp_fused(k, m):
    h, f = 640, 2048
    gu = (RNG.standard_normal((2 * f, h)) / np.sqrt(h)).astype(np.float16)
    dn = (RNG.standard_normal((h, f)) / np.sqrt(f)).astype(np.float16)
    r = (RNG.standard_normal((m, h)) * 30).astype(np.float32)
    o = RNG.standard_normal((m, h)).astype(np.float32)
    w_post, w_norm = (1 + RNG.standard_normal(h).astype(np.float32) * 0.1 for _ in range(2))
    out = cp.zeros((m, h), cp.float32)
    resid_out = cp.full((m, h), np.nan, cp.float32)
    k.mlp_fused(cp.asarray(gu), cp.asarray(dn), cp.asarray(o), cp.asarray(r), resid_out, cp.asarray(w_post),
                cp.asarray(w_norm), EPS, out)
    new = r + OPS.rms_norm(o, w_post, EPS)
    x = OPS.rms_norm(new, w_norm, EPS).astype(np.float64)
    g = x @ gu[:f].astype(np.float64).T
    u = x @ gu[f:].astype(np.float64).T
    ref = OPS.gelu_tanh_mul(g, u) @ dn.astype(np.float64).T
    assert rel(resid_out.get(), new) < 1e-6
    assert rel(out.get(), ref) < 1e-3
