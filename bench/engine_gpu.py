"""The CuPy engine's GPU speed, measured the way llama.cpp's benches measure theirs.

    python -m bench.engine_gpu --model MODEL.gguf --repeats 3 --json out.json

MODEL: any GGUF whose architecture the GPU engine runs (Gemma 3, Llama family: workers/cupy/models.py);
without --model, random weights of Gemma 3 270M's shapes (timing only).

- prefill, GPU runner: one 512-token prompt in one forward, device time (CUDA events around the forward, inputs
  already on the GPU), tokens/s;
- prefill, whole engine: wall clock from handing a fresh 512-token prompt to the engine (`Engine.add`, then
  `Engine.step` as the worker's engine thread drives it) to its first token back on the host: scheduling,
  block allocation, host-side batch building, the eager forward and the sampler included; 512 / seconds, the
  same unit as llama-bench pp512 (also a wall clock, but without a sampled token);
- decode, batch 1: 128 greedy tokens after a 1-token prompt (llama-bench tg128), each step replaying the
  CUDA graph and copying the chosen id to the host (what a serving engine must do per token);
- decode, batch 64: 64 sequences with 128-token prompts, 128 steps each (llama-batched-bench -npp 128
  -ntg 128 -npl 64, its S_TG), aggregate tokens/s; `--batches 128 256` adds the same at those batches (the
  served engine's full batch is 256 on the H200 profile);
- the device time of one decode graph replay at each batch (`graph_step_us_bN`: CUDA events around 50
  back-to-back replays, no host work between them), against which a served step's wall time compares;
- the same decode cases through the whole engine (scheduler, block manager, sampler: Python per step).
The first run of each case is a discarded warm-up; CUDA events time the device-only prefill, wall clock
(host synchronised every step) the decode loops and the engine's prefill.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp
import numpy as np

BS = 16


def random_ids(rng, vocab: int, shape):
    """Prompt token ids inside the vocabulary (Gemma's 262k or Llama's 49k), clear of its special tokens."""
    return rng.integers(1000, min(200_000, vocab), shape)


def runner_setup(model, kv, n_seqs: int, prompt_len: int, max_blocks: int):
    """Block tables for n_seqs sequences with disjoint blocks, and their prompts prefilled eagerly."""
    from workers.cupy.gpu.gemma3 import Workspace

    tables = np.arange(n_seqs * max_blocks, dtype=np.int32).reshape(n_seqs, max_blocks)
    rng = np.random.default_rng(0)
    tok = random_ids(rng, model.cfg.vocab_size, (n_seqs, prompt_len)).astype(np.int32)
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


def sync_device() -> None:
    cp.cuda.get_current_stream().synchronize()


def bench_engine(engine, n_seqs: int, prompt_len: int, steps: int, repeats: int, sampling=None,
                 sync=sync_device) -> list[float]:
    """Decode tokens/s through the engine: requests are prefilled first, then the decode phase is timed.
    `sampling`: the requests' SamplingParams (default greedy)."""
    from workers.protocol import GenerateRequest, SamplingParams

    sampling = sampling or SamplingParams(temperature=0.0)
    rng = np.random.default_rng(1)
    out = []
    for r in range(repeats + 1):
        for i in range(n_seqs):
            ids = random_ids(rng, engine.vocab_size, prompt_len).tolist()
            engine.add(GenerateRequest(request_id=f"{r}-{i}", prompt_ids=ids, max_tokens=steps,
                                       sampling=sampling, ignore_eos=True))
        generated = 0
        while generated < n_seqs:  # prefill steps (each sequence's first token comes from its prefill)
            generated += sum(len(o.token_ids) for o in engine.step())
        sync()
        t0 = time.perf_counter()
        n = 0
        while engine.has_work():
            n += sum(len(o.token_ids) for o in engine.step())
        dt = time.perf_counter() - t0
        if r:
            out.append(n / dt)
    return out


def bench_engine_prefill(engine, n_tokens: int, repeats: int, sync=sync_device) -> list[float]:
    """Prompt tokens/s to the first token through the engine: n_tokens / the wall seconds from `engine.add` of a
    greedy request to the `engine.step` that returns its first token (as an int on the host), the engine idle
    before each. Each repeat a fresh random prompt, so no prefix of it is cached; the first is a warm-up."""
    from workers.protocol import GenerateRequest, SamplingParams

    rng = np.random.default_rng(2)
    out = []
    for r in range(repeats + 1):
        assert not engine.has_work(), "the engine must be idle: its other requests would share the step"
        ids = random_ids(rng, engine.vocab_size, n_tokens).tolist()
        request = GenerateRequest(request_id=f"prefill-{r}", prompt_ids=ids, max_tokens=1,
                                  sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        sync()
        t0 = time.perf_counter()
        engine.add(request)
        first = []
        while not first:
            if not engine.has_work():
                raise RuntimeError(f"{request.request_id} left the engine without a token")
            first = [o for o in engine.step() if o.request_id == request.request_id and o.token_ids]
        dt = time.perf_counter() - t0
        if r:
            out.append(n_tokens / dt)
    return out


def profile_step(model, kv, n_seqs: int, prompt_len: int, decode: bool) -> dict:
    """Device time per op kind for one eager step (a prefill of n_seqs x prompt_len tokens, or one decode token
    per sequence after it), launches queued behind a spin kernel so that they run back to back (the events
    then time kernels, not Python's launch gaps)."""
    from workers.cupy.gpu.gemma3 import Workspace

    ws, args, tables = runner_setup(model, kv, n_seqs, prompt_len, -(-(prompt_len + 1) // BS))
    model.run(ws, *args, kv, BS)  # the prompt's K/V, and a warm-up
    if decode:
        p = prompt_len
        rows = np.arange(n_seqs, dtype=np.int32)
        slots = tables[:, p // BS].astype(np.int64) * BS + p % BS
        args = [cp.asarray(a) for a in (np.full(n_seqs, 1000, np.int32), np.full(n_seqs, p, np.int32), slots, rows,
                                        tables, rows.astype(np.int64))]
        ws = Workspace.allocate(model.cfg, n_seqs, n_seqs, model.act)
        model.run(ws, *args, kv, BS, decode=True)
    k, blas, marks = model.kernels, model.blas, []

    def wrap(obj, name, label):
        f = getattr(obj, name)

        def g(*a, **kw):
            f(*a, **kw)
            e = cp.cuda.Event()
            e.record()
            marks.append((label(*a) if callable(label) else label, e))
        setattr(obj, name, g)

    # Gemma's kernels and Llama's (workers/cupy/gpu/llama.py); a name the model's kernels lack is skipped
    names = [n for n in ("embed_norm", "add_norm", "qkv_post", "attention", "gelu_mul", "argmax_rows", "mlp_fused",
                         "residual_norm", "rope_qkv", "silu_mul") if hasattr(k, n)]
    for name in names:
        wrap(k, name, name)
    wrap(blas, "linear", lambda x, w, out: f"gemm {w.shape[0]}x{w.shape[1]}")
    wrap(k, "gemv", lambda mode, w, out, **kw: f"gemv{mode} {w.shape[0]}x{w.shape[1]}")
    try:
        k.spin(40_000_000)
        e0 = cp.cuda.Event()
        e0.record()
        model.run(ws, *args, kv, BS, decode=decode)
        cp.cuda.get_current_stream().synchronize()
    finally:
        for name in [*names, "gemv"]:
            delattr(k, name)
        delattr(blas, "linear")
    totals, prev = {}, e0
    for label, e in marks:
        totals[label] = totals.get(label, 0.0) + cp.cuda.get_elapsed_time(prev, e) * 1e3
        prev = e
    totals["total"] = sum(totals.values())
    return {key: round(v, 1) for key, v in totals.items()}


def graph_step_us(graphs, n_seqs: int, reps: int = 50) -> float:
    """Device time of one graph replay (events around `reps` back-to-back replays)."""
    g = graphs.size_for(n_seqs)
    graphs.replay(g)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(reps):
        graphs.replay(g)
    e1.record()
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps


def empty_node_us(model, n: int = 200) -> float:
    """Replay cost of one near-empty kernel node in a graph: the floor under every launch of a step."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        model.kernels.spin(0)
        stream.begin_capture()
        for _ in range(n):
            model.kernels.spin(0)
        graph = stream.end_capture()
        graph.launch(stream)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        for _ in range(10):
            graph.launch(stream)
        e1.record(stream)
        e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / (10 * n)


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "samples": xs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF file of an architecture the GPU engine runs (Gemma 3, Llama family); "
                                    "without it, random weights of Gemma 3 270M's shapes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--act", default="float16")
    ap.add_argument("--json")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-op device time of eager steps")
    ap.add_argument("--batches", type=int, nargs="*", default=[],
                    help="decode batches beyond 1 and 64 (e.g. 128 256: the h200 profile's full batch)")
    a = ap.parse_args()
    batches = sorted({64, *a.batches})

    from workers.cupy.gpu import create_gpu_engine
    from workers.cupy.gpu.graphs import DecodeGraphs
    from workers.cupy.models import build_gpu_model, config_for
    from workers.cupy.weights import load_weights
    from workers.protocol.model import load_model_info

    if a.model:
        info = load_model_info(a.model)
        weights = load_weights(a.model)
    else:  # timing only: the same shapes, random values
        from tests.gpu.test_gemma3_gpu import random_weights

        from workers.protocol.model import ModelInfo

        hp = {"gemma3.block_count": 18, "gemma3.embedding_length": 640, "gemma3.attention.head_count": 4,
              "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
              "gemma3.feed_forward_length": 2048, "gemma3.rope.freq_base": 1e6}
        info = ModelInfo(path="", architecture="gemma3", context_length=32768, vocab_size=262_144, bos_token_id=2,
                         eos_token_ids=(1,), add_bos=True, chat_template=None, hparams=hp)
        weights = random_weights(config_for(info))
    t0 = time.perf_counter()
    model = build_gpu_model(info, weights, act=a.act, graph_sizes=(1, *batches), max_model_len=1024)
    kv = model.kv_storage(batches[-1] * 64, BS)
    graphs = DecodeGraphs(model, kv, BS, (1, *batches), 64)
    setup_s = time.perf_counter() - t0
    res = {
        "model": a.model or "random weights, Gemma 3 270M shapes",
        "architecture": info.architecture,
        "setup_s": setup_s,
        "prefill_512": summary(bench_prefill(model, kv, 512, a.repeats * 3)),
        "decode_b1": summary(bench_decode(model, kv, graphs, 1, 1, 128, a.repeats)),
    }
    res["empty_node_us"] = empty_node_us(model)
    att = getattr(getattr(model, "kernels", None), "_f", {}).get("attention")
    if att is not None:  # what bounds its blocks per SM (PULSE_GPU_ATT_MIN_BLOCKS, PULSE_GPU_ATT_UNROLL)
        res["attention_kernel"] = {k: getattr(att, k, None) for k in ("num_regs", "local_size_bytes",
                                                                      "shared_size_bytes")}
    res["graph_step_us_b1"] = graph_step_us(graphs, 1)
    for n in batches:  # graph_step_us replays what bench_decode left loaded: n sequences at 128..255 tokens
        res[f"decode_b{n}"] = summary(bench_decode(model, kv, graphs, n, 128, 128, a.repeats))
        res[f"graph_step_us_b{n}"] = graph_step_us(graphs, n)
    if a.profile:
        res["profile_decode_b1_ctx64"] = profile_step(model, kv, 1, 64, True)
        for n in batches:
            res[f"profile_decode_b{n}_ctx128"] = profile_step(model, kv, n, 128, True)
        res["profile_prefill512"] = profile_step(model, kv, 1, 512, False)
    if not a.no_engine:
        del graphs, kv
        kw = {"block_size": BS, "num_blocks": batches[-1] * 20, "max_num_seqs": batches[-1],
              "max_step_tokens": 8192, "context_length": 1024}
        eng = create_gpu_engine(info, weights, act=a.act, **kw)
        res["engine_prefill_512"] = summary(bench_engine_prefill(eng, 512, a.repeats * 3))
        res["engine_prefill_512"]["first_token_ms_median"] = 512e3 / res["engine_prefill_512"]["median"]
        res["engine_decode_b1"] = summary(bench_engine(eng, 1, 1, 128, a.repeats))
        for n in batches:
            res[f"engine_decode_b{n}"] = summary(bench_engine(eng, n, 128, 128, a.repeats))
    res["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{res['model']} ({res['architecture']})")
    for k, v in res.items():
        if isinstance(v, dict) and "median" in v:
            print(f"{k:20s} median {v['median']:10.1f} tok/s  min {v['min']:10.1f}  max {v['max']:10.1f}  n={v['n']}"
                  + (f"  (first token {v['first_token_ms_median']:.2f} ms)" if "first_token_ms_median" in v else ""))
        elif isinstance(v, (dict, float)):
            print(f"{k:20s} {v}")
    print(f"setup {setup_s:.1f} s on {res['device']}")

if __name__ == "__main__":
    main()
