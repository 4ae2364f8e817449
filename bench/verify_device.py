"""Device time of one stream's steps by their width: a decode step (1 token) against speculative verify steps
(1 + K tokens), on the GPU engine, code-edit prompts (bench/speculation.py's), greedy, fixed K.

A verify step of one sequence reads the same weights as a decode step, so it was expected to cost about as much;
on an H100 it took ~1.6 ms of engine wall time at K 8 against ~1.0 ms for a decode step (workers/cupy/gpu/NOTES.md),
and served at one client a speculative step waited on the device for most of its ~2 ms. This times the device
alone: CUDA events recorded on the compute stream around each `model.forward` (the step's graph replay and its
in-step draw), the host waiting for the second before the next step is built, so each figure is one step's device
span from its launch (the device otherwise idle) to its end. Per K: the steps' median and p90 milliseconds by the
number of tokens the step ran, how many, and the wall tok/s of the run (with the waits, so below the engine's own).

    python -m bench.verify_device --model $GGUF --ks 0 4 8 16 --tokens 256
    nsys profile -t cuda --cuda-graph-trace=node --stats=true python -m bench.verify_device --model $GGUF --ks 8
        # the graph's kernels one by one (nsys's cuda_gpu_kern_sum), where nsys is installed
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def timed_forward(model, log: dict):
    """Wrap `model.forward`: each call's device span in ms, appended to log[number of tokens]."""
    import cupy as cp

    forward = model.forward
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def run(batch, kv):
        start.record()
        out = forward(batch, kv)
        end.record()
        end.synchronize()
        log.setdefault(int(batch.num_tokens), []).append(cp.cuda.get_elapsed_time(start, end))
        return out
    model.forward = run
    return forward


def main(argv=None) -> int:
    from bench import speculation as spec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the GGUF (default: the bundled model package)")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="requests per K (after one warm-up request)")
    ap.add_argument("--json", help="write the per-K figures here")
    args = ap.parse_args(argv)
    spec.MODEL = args.model
    engine, device, info = spec.build_engine("cuda", 8, 1 << 16, 2048)
    engine.overlap = False  # each step is read before the next is built: its device span is its own
    prompt = spec.grid_prompts(info, args.context, 1, "code")[0]
    out, counter = {}, iter(range(10**9))
    print(f"{device}: one stream, code edit, context {len(prompt)}, {args.tokens} tokens, greedy")
    print("| K | step tokens | steps | device ms, median | p90 | wall tok/s of the run |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in args.ks:
        spec.set_policy(engine, spec.fixed_k(k) if k else None)
        spec.decode(engine, [spec.request(f"w{next(counter)}", prompt, args.tokens)])  # graphs captured, cache warm
        log: dict = {}
        forward = timed_forward(engine.model, log)
        t0, made = time.perf_counter(), 0
        for _ in range(args.rounds):
            r = spec.decode(engine, [spec.request(f"r{next(counter)}", prompt, args.tokens)])
            made += r["made"]
        wall = time.perf_counter() - t0
        engine.model.forward = forward
        out[k] = {str(n): {"steps": len(v), "median_ms": float(np.median(v)), "p90_ms": float(np.percentile(v, 90))}
                  for n, v in sorted(log.items())}
        for n, v in sorted(log.items()):
            if len(v) >= 3:
                print(f"| {k} | {n} | {len(v)} | {np.median(v):.3f} | {np.percentile(v, 90):.3f} | "
                      f"{made / wall:,.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "context": len(prompt), "tokens": args.tokens, "by_k": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
