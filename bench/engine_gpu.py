"""The CuPy engine's GPU speed, measured the way llama.cpp's benches measure theirs.

    python -m bench.engine_gpu --model MODEL.gguf --repeats 3 --json out.json

- prefill: one 512-token prompt in one step (llama-bench pp512), tokens/s;
- decode, batch 1: 128 greedy tokens after a 1-token prompt (llama-bench tg128), each step replaying the
  CUDA graph and copying the chosen id to the host (what a serving engine must do per token);
- decode, batch 64: 64 sequences with 128-token prompts, 128 steps each (llama-batched-bench -npp 128
  -ntg 128 -npl 64, its S_TG), aggregate tokens/s;
- the same two decode cases through the whole engine (scheduler, block manager, sampler: Python per step).
The first run of each case is a discarded warm-up; CUDA events time the device-only prefill, wall clock
(host synchronised every step) the decode loops.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp
import numpy as np

BS = 16


def runner_setup(model, kv, n_seqs: int, prompt_len: int, max_blocks: int):
    """Block tables for n_seqs sequences with disjoint blocks, and their prompts prefilled eagerly."""
    from workers.cupy.gpu.gemma3 import Workspace

    tables = np.arange(n_seqs * max_blocks, dtype=np.int32).reshape(n_seqs, max_blocks)
    rng = np.random.default_rng(0)
    tok = rng.integers(1000, 200_000, (n_seqs, prompt_len)).astype(np.int32)
    pos = np.tile(np.arange(prompt_len, dtype=np.int32), n_seqs)
    rows = np.repeat(np.arange(n_seqs, dtype=np.int32), prompt_len)
    slots = (tables[rows, pos // BS].astype(np.int64) * BS + pos % BS)
    last = (np.arange(n_seqs) * prompt_len + prompt_len - 1).astype(np.int64)
    ws = Workspace.allocate(model.cfg, n_seqs * prompt_len, n_seqs, model.act)
    args = [cp.asarray(a) for a in (tok.ravel(), pos, slots, rows, tables, last)]
    return ws, args, tables


def bench_prefill(model, kv, n_tokens: int, repeats: int) -> list[float]:
    ws, args, _ = runner_setup(model, kv, 1, n_tokens, -(-n_tokens // BS))
    out = []
    for r in range(repeats + 1):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        model.run(ws, *args, kv, BS)
        end.record()
        end.synchronize()
        if r:  # the first is the warm-up
            out.append(n_tokens / (cp.cuda.get_elapsed_time(start, end) / 1e3))
    return out


def bench_decode(model, kv, graphs, n_seqs: int, prompt_len: int, steps: int, repeats: int) -> list[float]:
    ws, args, tables = runner_setup(model, kv, n_seqs, prompt_len, graphs.max_blocks)
    model.run(ws, *args, kv, BS)
    first = ws.chosen.copy()
    g = graphs.size_for(n_seqs)
    host_ids = np.empty(n_seqs, np.int32)
    out = []
    for r in range(repeats + 1):
        # every repeat decodes the same positions again (their K/V is simply rewritten)
        graphs.load(first, np.full(n_seqs, prompt_len, np.int32), tables, g)
        cp.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            graphs.replay(g)
            model.kernels.advance(graphs.ws.chosen, n_seqs, graphs.tok, graphs.inp)
            graphs.ws.chosen[:n_seqs].get(out=host_ids)  # synchronises: the engine needs the ids every step
        dt = time.perf_counter() - t0
        if r:
            out.append(n_seqs * steps / dt)
    return out


def bench_engine(engine, n_seqs: int, prompt_len: int, steps: int, repeats: int) -> list[float]:
    """Decode tokens/s through the engine: requests are prefilled first, then the decode phase is timed."""
    from workers.protocol import GenerateRequest, SamplingParams

    rng = np.random.default_rng(1)
    out = []
    for r in range(repeats + 1):
        for i in range(n_seqs):
            ids = rng.integers(1000, 200_000, prompt_len).tolist()
            engine.add(GenerateRequest(request_id=f"{r}-{i}", prompt_ids=ids, max_tokens=steps,
                                       sampling=SamplingParams(temperature=0.0), ignore_eos=True))
        generated = 0
        while generated < n_seqs:  # prefill steps (each sequence's first token comes from its prefill)
            generated += sum(len(o.token_ids) for o in engine.step())
        cp.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        n = 0
        while engine.has_work():
            n += sum(len(o.token_ids) for o in engine.step())
        dt = time.perf_counter() - t0
        if r:
            out.append(n / dt)
    return out


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "samples": xs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF file; without it, random weights of Gemma 3 270M's shapes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--act", default="float16")
    ap.add_argument("--json")
    ap.add_argument("--no-engine", action="store_true")
    a = ap.parse_args()

    from workers.cupy.gemma3 import Gemma3Config
    from workers.cupy.gpu import create_gpu_engine
    from workers.cupy.gpu.gemma3 import GpuGemma3
    from workers.cupy.gpu.graphs import DecodeGraphs
    from workers.cupy.weights import load_weights
    from workers.protocol.model import load_model_info

    if a.model:
        info = load_model_info(a.model)
        weights = load_weights(a.model)
        cfg = Gemma3Config.from_hparams(info.hparams, info.vocab_size)
    else:  # timing only: the same shapes, random values
        from tests.gpu.test_gemma3_gpu import random_weights

        cfg = Gemma3Config(n_layers=18, hidden=640, n_heads=4, n_kv_heads=1, head_dim=256, ffn=2048,
                           vocab_size=262_144, eps=1e-6, rope_base_global=1e6, query_scale=1 / 16)
        weights, a.no_engine = random_weights(cfg), True
    t0 = time.perf_counter()
    model = GpuGemma3(cfg, weights, act=a.act, graph_sizes=(1, 64), max_model_len=1024)
    kv = model.kv_storage(64 * 64, BS)
    graphs = DecodeGraphs(model, kv, BS, (1, 64), 64)
    setup_s = time.perf_counter() - t0
    res = {
        "setup_s": setup_s,
        "prefill_512": summary(bench_prefill(model, kv, 512, a.repeats * 3)),
        "decode_b1": summary(bench_decode(model, kv, graphs, 1, 1, 128, a.repeats)),
        "decode_b64": summary(bench_decode(model, kv, graphs, 64, 128, 128, a.repeats)),
    }
    if not a.no_engine:
        del graphs, kv
        kw = dict(block_size=BS, num_blocks=64 * 20, max_num_seqs=64, max_step_tokens=8192, context_length=1024)
        eng = create_gpu_engine(info, weights, act=a.act, **kw)
        res["engine_decode_b1"] = summary(bench_engine(eng, 1, 1, 128, a.repeats))
        res["engine_decode_b64"] = summary(bench_engine(eng, 64, 128, 128, a.repeats))
    res["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    for k, v in res.items():
        if isinstance(v, dict):
            print(f"{k:20s} median {v['median']:10.1f} tok/s  min {v['min']:10.1f}  max {v['max']:10.1f}  n={v['n']}")
    print(f"setup {setup_s:.1f} s on {res['device']}")


if __name__ == "__main__":
    main()
