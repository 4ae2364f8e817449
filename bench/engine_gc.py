"""Garbage collection in an engine process under served load, without a GPU (issue 25): how much of its wall time the
step thread loses to the collector, with `workers.engine.quiet_gc` on and off (Python's defaults, the default:
served on the H200 quiet_gc was no faster, BENCHMARKS.md).

Each variant runs in a process of its own (collector state is per process) what the engine process runs, less the
device: the real EngineLoop (step outputs held per stream and handed over, each hand-over encoded with msgspec as
the engine process sends it) stepping a real Engine, Scheduler, BlockManager and sampler staging over
bench/step_host.py's FreeModel (a forward that costs nothing: a test double isolating the host's work, which is what
the collector competes with), the stats thread's engine_snapshot every 50 ms, and a closed loop of requests (`--batch`
running plus `--queue` waiting, as the h200 profile's 256 + 128; each finished request replaced at once by a new one
of `--prompt` distinct tokens and `--tokens` new tokens). The KV pools have `--kv-tokens` tokens (the h200 profile's
1,048,576: 65,536 blocks, each a Python object the collector walks) and the window pool as the GPU engine plans it.
Variants alternate, `--repeats` times; per variant the median (min-max) of steps/s, generated tok/s, the share of
wall time spent collecting (gc.callbacks) and the whole-heap collections a second.

    python -m bench.engine_gc --seconds 20 --repeats 3
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time

from bench.machine import describe, machine_info


def run_one(args) -> dict:
    """One variant, in this process: the measurement as a dict."""
    import msgspec

    from bench.step_host import BLOCK, FreeModel, staging_sampler
    from workers.cupy.engine import Engine
    from workers.cupy.engine_loop import EngineLoop, GcClock, engine_snapshot, quiet_gc
    from workers.cupy.kv_cache import BlockManager
    from workers.cupy.scheduler import Scheduler
    from workers.protocol import GenerateRequest, SamplingParams

    window = 512  # Gemma 3's sliding window: a second pool, its blocks beyond the window slid out
    blocks = BlockManager(args.kv_tokens // BLOCK, BLOCK, num_local=args.batch * (window // BLOCK + 2), window=window)
    engine = Engine(FreeModel(), None, blocks, Scheduler(blocks, args.batch, 2048), staging_sampler(args.batch), (1,),
                    1 << 20, FreeModel.vocab, 0, overlap=True)
    encode = msgspec.msgpack.Encoder().encode
    handovers = [0]
    arrivals = iter(range(1 << 62))
    done = threading.Event()

    def request() -> GenerateRequest:
        n = next(arrivals)
        return GenerateRequest(request_id=f"r{n}", prompt_ids=[2 + (n * 7 + j) % 509 for j in range(args.prompt)],
                               max_tokens=args.tokens, sampling=SamplingParams(temperature=1.0), ignore_eos=True)

    def emit(outputs) -> None:
        handovers[0] += 1
        encode(outputs)  # as the engine process does before it sends them
        for out in outputs:
            if out.finish_reason is not None and not done.is_set():
                loop.inbox.put(("add", request()))

    loop = EngineLoop(engine, emit=emit, emit_one=lambda rid, item: None)
    if args.variant == "quiet":
        quiet_gc()
    for _ in range(args.batch + args.queue):
        loop.inbox.put(("add", request()))

    def stats() -> None:
        while not done.wait(0.05):
            engine_snapshot(engine)

    threading.Thread(target=stats, daemon=True).start()
    stepper = threading.Thread(target=loop.run, daemon=True)
    stepper.start()
    time.sleep(args.warmup)
    clock = GcClock.installed()
    gc0, counts0 = clock.seconds, [g["collections"] for g in gc.get_stats()]
    steps0 = engine.scheduler.steps
    t0 = time.perf_counter()
    generated = 0
    last = time.monotonic()
    while time.perf_counter() - t0 < args.seconds:  # count tokens from the engine's own per-step record
        time.sleep(0.5)
        now = time.monotonic()
        generated += sum(r[1] for r in list(engine._recent) if last < r[0] <= now)
        last = now
    wall = time.perf_counter() - t0
    out = {"variant": args.variant, "steps_s": (engine.scheduler.steps - steps0) / wall, "tok_s": generated / wall,
           "gc_share": (clock.seconds - gc0) / wall,
           **{f"gen{i}_s": (g["collections"] - c) / wall for i, (g, c) in enumerate(zip(gc.get_stats(), counts0))},
           "tracked": len(gc.get_objects()), "running": len(engine.scheduler.running), "handovers": handovers[0]}
    done.set()
    loop.inbox.put((object(), None))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["quiet", "default"], choices=["quiet", "default"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--queue", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv-tokens", type=int, default=1 << 20)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(run_one(args)))
        return 0
    print(describe(machine_info()))
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for _ in range(args.repeats):
        for v in args.variants:
            res = subprocess.run([sys.executable, "-m", "bench.engine_gc", *passthrough, "--variant", v],
                                 capture_output=True, text=True, check=True)
            runs[v].append(json.loads(res.stdout.strip().splitlines()[-1]))
    cols = [("steps_s", "steps/s", 0), ("tok_s", "tok/s", 0), ("gc_share", "GC share of wall time", 3),
            ("gen0_s", "young collections / s", 1),
            ("gen2_s", "whole-heap collections / s", 2), ("tracked", "objects the collector tracks", 0)]
    print("| gc | " + " | ".join(c[1] for c in cols) + " |")
    print("|" + " --- |" * (1 + len(cols)))
    for v, rs in runs.items():
        cells = []
        for key, _, digits in cols:
            xs = sorted(r[key] for r in rs)
            cells.append(f"{xs[len(xs) // 2]:,.{digits}f} ({xs[0]:,.{digits}f}–{xs[-1]:,.{digits}f})")
        print(f"| {v} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
