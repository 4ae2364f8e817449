"""The engine's NumPy (CPU) path speed, through the whole engine (scheduler, paged KV, sampler).

    python -m bench.engine_cpu --repeats 5 [--threads 1] [--json out.json]

Cases, interleaved in every repeat after one discarded warm-up round:
- prefill: one 512-token prompt in one step, prompt tokens/s;
- decode b1: one sequence, 64 greedy tokens after a short prompt, tokens/s of the decode steps;
- decode b8: eight sequences at once, 32 greedy tokens each, aggregate tokens/s of the decode steps.
Reports median, min and max over the repeats, with the machine's load average beside them. Each case
is given twice: per wall-clock second, and per second of this process' CPU time (tokens over
time.process_time), which a shared, loaded box distorts far less than wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from workers.cupy.engine import create_engine
from workers.cupy.models import build_model
from workers.cupy.ops import Ops
from workers.cupy.weights import load_weights
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info

GREEDY = SamplingParams(temperature=0.0)


def decode_rate(model, info, n_seqs: int, n_tokens: int) -> float:
    """Aggregate generated tokens/s over the steps after the prefill step."""
    engine = _engine(model, info, n_seqs)
    rng = np.random.default_rng(n_seqs)
    for i in range(n_seqs):
        prompt = [info.bos_token_id] + rng.integers(1000, 100_000, 15).tolist()
        engine.add(GenerateRequest(request_id=f"d{i}", prompt_ids=prompt, max_tokens=n_tokens, sampling=GREEDY,
                                   ignore_eos=True))
    engine.step()  # every prompt prefills in this first step
    generated, t0, c0 = 0, time.perf_counter(), time.process_time()
    while engine.has_work():
        generated += len(engine.step())
    return generated / (time.perf_counter() - t0), generated / (time.process_time() - c0)


def prefill_rate(model, info, n_tokens: int = 512) -> float:
    engine = _engine(model, info, 1)
    prompt = [info.bos_token_id] + np.random.default_rng(0).integers(1000, 100_000, n_tokens - 1).tolist()
    engine.add(GenerateRequest(request_id="p", prompt_ids=prompt, max_tokens=1, sampling=GREEDY))
    t0, c0 = time.perf_counter(), time.process_time()
    engine.step()
    return n_tokens / (time.perf_counter() - t0), n_tokens / (time.process_time() - c0)


def _engine(model, info, n_seqs: int):
    return create_engine(info, None, np, block_size=16, num_blocks=256, max_num_seqs=n_seqs,
                         max_step_tokens=2048, context_length=4096, model=model)


CASES = {
    "prefill 512 (tok/s)": lambda m, i: prefill_rate(m, i),
    "decode b1 (tok/s)": lambda m, i: decode_rate(m, i, 1, 64),
    "decode b8 (aggregate tok/s)": lambda m, i: decode_rate(m, i, 8, 32),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (the engine's default is 1)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=args.threads, user_api="blas")
    info = load_model_info(None)
    model = build_model(info, load_weights(info.path), Ops(np))
    samples: dict[str, list[float]] = {f"{name} {clock}": [] for name in CASES for clock in ("wall", "cpu")}
    for r in range(args.repeats + 1):
        for name, case in CASES.items():
            wall, cpu = case(model, info)
            if r:  # round 0 is the warm-up
                samples[f"{name} wall"].append(wall)
                samples[f"{name} cpu"].append(cpu)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_1m_at_end": os.getloadavg()[0], "blas_threads": args.threads,
        "cases": {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                  for name, v in samples.items()},
    }
    for name, s in result["cases"].items():
        print(f"{name:36s} median {s['median']:8.1f}  min {s['min']:8.1f}  max {s['max']:8.1f}  (n={s['n']})")
    print(f"machine: {result['machine']}; BLAS threads {args.threads}; load average {result['load_average_1m_at_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
