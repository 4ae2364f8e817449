"""What sampling costs on the GPU: the draw kernels alone, and decode through the whole engine, greedy
against temperature 1 (OpenAI's default), interleaved.

    python -m bench.sampling_gpu --model MODEL.gguf --repeats 5 --json out.json

- kernels (device time, CUDA events over 50 back-to-back launches, median of --repeats): over B rows of a
  262,144-entry vocabulary, the plain two-stage argmax, the sampling kernels with every row greedy, every row
  at temperature 1, and at temperature 1 with the chosen token's logprob;
- engine (wall time, host synchronised every step, as bench/engine_gpu.py): decode tok/s at batch 1 and 64,
  greedy and temperature 1, configurations interleaved per repeat.
"""
from __future__ import annotations

import argparse
import json
import statistics

import cupy as cp
import numpy as np

from bench.engine_gpu import bench_engine, summary
from workers.cupy.gpu.kernels import DeviceDraws, Kernels, argmax_chunks
from workers.cupy.rng import row_key
from workers.cupy.sampler import SampleRow

VOCAB = 262_144


def kernel_us(k: Kernels, rows: int, mode: str, reps: int = 50) -> float:
    """Device µs per launch pair (stage 1 + 2) for `rows` rows."""
    from workers.protocol import SamplingParams

    logits = cp.asarray(np.random.default_rng(rows).standard_normal((rows, VOCAB), np.float32) * 3)
    n = argmax_chunks(VOCAB)
    pv, pi = cp.empty((rows, n), cp.float32), cp.empty((rows, n), cp.int32)
    pm, ps = cp.empty((rows, n), cp.float32), cp.empty((rows, n), cp.float32)
    out, lp = cp.empty(rows, cp.int32), cp.empty(rows, cp.float32)
    temp = 0.0 if mode == "sample_greedy" else 1.0
    host = np.zeros((rows, 4), np.int32)
    DeviceDraws.pack([SampleRow(SamplingParams(temperature=temp), row_key(1, i), 0 if mode == "sample_t1_lp" else None)
                      for i in range(rows)], host)
    params = cp.asarray(host)

    def launch():
        if mode == "argmax":
            k.argmax_rows(logits, out, pv, pi)
        else:
            k.sample(logits, params, out, lp, pv, pi, pm, ps)

    launch()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(reps):
        launch()
    e1.record()
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    k = Kernels(256, 4, "float16")
    modes = ("argmax", "sample_greedy", "sample_t1", "sample_t1_lp")
    res: dict = {"kernels_us": {}}
    for rows in (1, 8, 64):
        samples = {m: [] for m in modes}
        for _ in range(a.repeats):
            for m in modes:
                samples[m].append(kernel_us(k, rows, m))
        res["kernels_us"][rows] = {m: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                   for m, v in samples.items()}

    from workers.cupy.gpu import create_gpu_engine
    from workers.cupy.weights import load_weights
    from workers.protocol import SamplingParams
    from workers.protocol.model import load_model_info

    info = load_model_info(a.model)
    eng = create_gpu_engine(info, load_weights(a.model), block_size=16, num_blocks=64 * 20, max_num_seqs=64,
                            max_step_tokens=8192, context_length=1024)
    arms = {"greedy": SamplingParams(temperature=0.0), "t1": SamplingParams(temperature=1.0)}
    engine = {f"{name}_b{b}": [] for b in (1, 64) for name in arms}
    for r in range(a.repeats + 1):  # the first round warms up and is discarded
        for b in (1, 64):
            for name in (list(arms) if r % 2 else list(arms)[::-1]):
                v = bench_engine(eng, b, 128, a.steps, 1, arms[name])[0]
                if r:
                    engine[f"{name}_b{b}"].append(v)
    res["engine_tok_s"] = {key: summary(v) for key, v in engine.items()}
    res["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    for rows, ms in res["kernels_us"].items():
        print(f"kernels rows={rows:3d}: " + "  ".join(f"{m} {s['median']:.1f} us" for m, s in ms.items()))
    for key, s in res["engine_tok_s"].items():
        print(f"engine {key:10s} median {s['median']:9.1f} tok/s  min {s['min']:9.1f}  max {s['max']:9.1f}")
    for b in (1, 64):
        g, t = res["engine_tok_s"][f"greedy_b{b}"]["median"], res["engine_tok_s"][f"t1_b{b}"]["median"]
        print(f"t1/greedy at batch {b}: {t / g:.3f}")


if __name__ == "__main__":
    main()
