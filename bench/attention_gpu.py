"""The decode attention kernel alone, at full batches, in compile-time variants side by side (issue 25).

    python -m bench.attention_gpu --batches 64 128 256 --ctx 128 512 \\
        --variants "" "MIN_BLOCKS=2 UNROLL=2" "XRED=1" --json out.json

Each variant is a set of PULSE_GPU_ATT_* settings (kernels.py reads them when it compiles the module; an empty
string is the defaults, BLOCKS=N the split target). One decode step's attention for one layer of Gemma 3 270M's
shape (one KV head, 4 query heads, head_dim 256, fp16 KV in 16-token blocks scattered over the pool as a busy
server's are), the fused path the engine takes on decode steps (QK-norm, RoPE and the KV write in the kernel).
Device time: CUDA events around 200 back-to-back launches after 20 warm-up ones, the median of --repeats. The KV
floor is the keys and values the step reads at 4.3 TB/s (DEVICE_FACTS.md's measured copy rate). Every variant's
output is compared with the first's (max abs difference): a variant that computes something else is flagged.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import cupy as cp
import numpy as np

HD, GROUP, BS = 256, 4, 16
FLOOR_BPS = 4.3e12


def setup(n_seqs: int, ctx: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    per = -(-(ctx + 1) // BS)
    n_blocks = n_seqs * per + 8
    tables = rng.permutation(n_blocks)[:n_seqs * per].astype(np.int32).reshape(n_seqs, per)
    pos = np.full(n_seqs, ctx, np.int32)  # the decode token at position ctx attends to ctx + 1 keys
    slots = (tables[:, ctx // BS].astype(np.int64) * BS + ctx % BS)
    kc = cp.asarray(rng.standard_normal((n_blocks * BS, 1, HD), np.float32) * 0.5).astype(cp.float16)
    vc = cp.asarray(rng.standard_normal((n_blocks * BS, 1, HD), np.float32)).astype(cp.float16)
    qkv = cp.asarray(rng.standard_normal((n_seqs, (GROUP + 2) * HD), np.float32))
    qn = cp.asarray(1 + 0.1 * rng.standard_normal(HD, np.float32))
    kn = cp.asarray(1 + 0.1 * rng.standard_normal(HD, np.float32))
    inv = 1.0 / (10000.0 ** (np.arange(HD // 2) * 2 / HD))
    ang = np.arange(ctx + 1)[:, None] * inv[None, :]
    rcos, rsin = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    return dict(kc=kc, vc=vc, tables=cp.asarray(tables), rows=cp.arange(n_seqs, dtype=cp.int32),
                pos=cp.asarray(pos), slots=cp.asarray(slots), qkv=qkv, qn=qn, kn=kn, rcos=rcos, rsin=rsin,
                out=cp.zeros((n_seqs, GROUP * HD), cp.float16),
                part=cp.zeros((n_seqs, 8, GROUP * HD + 2 * GROUP), cp.float32),
                counter=cp.zeros(n_seqs, cp.uint32))


def launch(k, d, n_split: int) -> None:
    k.attention(None, d["kc"], d["vc"], d["tables"], d["rows"], d["pos"], BS, 0, HD ** -0.5, 1, d["out"],
                fused=(d["qkv"], d["qn"], d["kn"], d["slots"], d["rcos"], d["rsin"], 1e-6), n_split=n_split,
                part=d["part"], counter=d["counter"])


def time_variant(k, d, n_split: int, repeats: int, n: int = 200) -> float:
    for _ in range(20):
        launch(k, d, n_split)
    out = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(n):
            launch(k, d, n_split)
        e1.record()
        e1.synchronize()
        out.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / n)
    return statistics.median(out)


def kernels_for(variant: str):
    import workers.cupy.gpu.kernels as km
    from bench.served import att_env  # the same KEY=VALUE form as the served pulse-att target's

    for key in [k for k in os.environ if k.startswith("PULSE_GPU_ATT_")]:
        del os.environ[key]
    os.environ.update(att_env(variant))
    km._module.cache_clear()
    km.attention_settings.cache_clear()
    k = km.Kernels(HD, GROUP, "float16")
    f = k._f["attention"]
    return k, {a: getattr(f, a, None) for a in ("num_regs", "local_size_bytes", "shared_size_bytes")}


def main() -> None:
    import workers.cupy.gpu.kernels as km

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--variants", nargs="+", default=[""])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    cases = [(b, c, setup(b, c)) for b in a.batches for c in a.ctx]
    rows, ref = [], {}
    for variant in a.variants:
        k, attrs = kernels_for(variant)
        for b, c, d in cases:
            n_split = km.attention_splits(b)
            us = time_variant(k, d, n_split, a.repeats)
            got = d["out"].astype(cp.float32)
            diff = float(cp.abs(got - ref[(b, c)]).max()) if (b, c) in ref else 0.0
            ref.setdefault((b, c), got.copy())
            floor_us = b * (c + 1) * HD * 2 * 2 / FLOOR_BPS * 1e6
            rows.append(dict(variant=variant or "defaults", batch=b, ctx=c, n_split=n_split, us=round(us, 2),
                             floor_us=round(floor_us, 2), x_floor=round(us / floor_us, 1), max_diff=diff, **attrs))
    print(f"{'variant':28} {'batch':>5} {'ctx':>5} {'split':>5} {'us':>8} {'floor':>7} {'x':>5} {'regs':>4} "
          f"{'local':>5} {'maxdiff':>8}")
    for r in rows:
        print(f"{r['variant']:28} {r['batch']:5d} {r['ctx']:5d} {r['n_split']:5d} {r['us']:8.1f} {r['floor_us']:7.1f} "
              f"{r['x_floor']:5.1f} {r['num_regs'] or 0:4d} {r['local_size_bytes'] or 0:5d} {r['max_diff']:8.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
