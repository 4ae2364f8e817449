"""The engine alone at the batches the served benchmark loads it with: the ceiling `pulse serve` is measured against.

    python -m bench.engine_batches --model MODEL.gguf --profile h200 --batches 1 16 64 256 --sampling greedy t1 \
        --tokens 128 --per-client 2 --repeats 2 --json out.json

The worker's own engine, built the way the worker builds it (workers/cupy/backend.py `EngineBackend._build`: the
device profile's KV, block size, speculation and speculation gate, `max_num_seqs` = the largest batch, as
bench/served.py configures `pulse serve`), driven from this thread with no HTTP, no gateway, no asyncio and no
detokenizer: B "clients" each send --per-client requests one after another (a closed loop, as bench/served.py's
clients do), the same story prompts bench/served.py sends (tokenized with the model's tokenizer, BOS first),
`ignore_eos`, --tokens new tokens each. tok/s = generated tokens / wall seconds from the first `add` to the last
token, prefill included: the same unit as bench/served.py's aggregate tok/s, so served / engine-alone at the same
batch is what the serving path keeps of the engine. Wall time; the engine reads its chosen ids back every step
(with `--overlap on`, the GPU engine's default, while the next step already runs: workers/cupy/engine.py). The
first repeat of every cell is a discarded warm-up (graph capture, caches).

Arrivals (`--arrivals`): `together` (every client's first request at once: they then finish and resend in step,
so one step in --tokens carries prompts; the cells bench/served.py reads) and `staggered` (client c's first
request at step c x tokens / B, so the B streams are spread over a request's lifetime, as served clients end up:
about B / tokens prompts arrive each step). `--prefill-wait` runs each cell at these scheduler
`prefill_wait_steps` (prefill coalescing, workers/cupy/scheduler.py; default: the profile's). Each cell reports
its steps by path on the GPU (graph / verify / mixed / eager forwards) and the steps a prompt was held back.
`--mixed on off` runs each cell with steps that carry prompt chunks replaying the verify graphs (the default) and
launched eagerly, interleaved (workers/cupy/gpu/verify.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench.protocol import spread
from bench.served import SAMPLING, prompts


def build_engine(model: str | None, profile_name: str | None, device: str, max_num_seqs: int, speculation: bool):
    """(engine, tokenizer, info) as a worker builds them (EngineBackend._build), with this max_num_seqs."""
    from policy.config import PulseConfig
    from policy.profiles import builtin_profiles, select_profile
    from workers.cupy.backend import EngineBackend
    from workers.cupy.device import array_module, device_name
    from workers.protocol.model import load_model_info

    cfg = {"workers": {"backend": "cupy", "engine": {"device": device, "max_num_seqs": max_num_seqs,
                                                     "speculation": speculation}}}
    if model:
        cfg["model"] = {"path": model}
    config = PulseConfig.model_validate(cfg)
    info = load_model_info(config.model.path)
    profile = select_profile(device_name(array_module(device)), builtin_profiles(), profile_name)
    backend = EngineBackend(config, profile, info)
    engine, tokenizer = backend._build()
    return engine, tokenizer, info


def run_cell(engine, prompt_ids: list[list[int]], batch: int, per_client: int, tokens: int, sampling: dict,
             tag: str, staggered: bool = False) -> tuple[int, float]:
    """Closed loop of `batch` clients x `per_client` requests: (generated tokens, wall seconds). `staggered`:
    client c's first request at engine step c x tokens // batch instead of all at once."""
    from workers.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(**sampling)
    left = {c: per_client for c in range(batch)}
    owner: dict[str, int] = {}
    nxt = iter(prompt_ids)

    def send(client: int) -> None:
        rid = f"{tag}-{client}-{left[client]}"
        left[client] -= 1
        owner[rid] = client
        engine.add(GenerateRequest(request_id=rid, prompt_ids=next(nxt), max_tokens=tokens, sampling=params,
                                   ignore_eos=True))

    assert not engine.has_work(), "the engine must be idle between cells"
    starts = sorted(((c * tokens // batch if staggered else 0), c) for c in range(batch))
    t0 = time.perf_counter()
    generated, steps = 0, 0
    while starts or engine.has_work():
        if not engine.has_work():
            steps = max(steps, starts[0][0])  # nothing running: the next start is now
        while starts and starts[0][0] <= steps:
            send(starts.pop(0)[1])
        steps += 1
        for out in engine.step():
            generated += len(out.token_ids)
            if out.finish_reason is not None:
                client = owner.pop(out.request_id)
                if left[client]:
                    send(client)
    return generated, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_batches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file; empty: Pulse's bundled model")
    ap.add_argument("--profile", help="device profile (default: detected)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--sampling", nargs="+", default=["greedy", "t1"], choices=list(SAMPLING))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-speculation", action="store_true", help="no speculator (as `max_draft_tokens: 0`)")
    ap.add_argument("--arrivals", nargs="+", default=["together"], choices=["together", "staggered"])
    ap.add_argument("--prefill-wait", type=int, nargs="+", help="scheduler prefill_wait_steps to run each cell at")
    ap.add_argument("--overlap", nargs="+", choices=["on", "off"],
                    help="run each cell with the engine's overlap on and/or off (default: as the worker builds it)")
    ap.add_argument("--mixed", nargs="+", choices=["on", "off"],
                    help="run each cell with the GPU model's mixed graphs (steps with prompt chunks replaying the "
                    "verify graphs) on and/or off (default: as the worker builds it)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    engine, tokenizer, info = build_engine(a.model, a.profile, a.device, max(a.batches), not a.no_speculation)
    bos = [info.bos_token_id] if info.add_bos and info.bos_token_id is not None else []
    setup_s = time.perf_counter() - t0
    res: dict = {"model": info.path, "setup_s": setup_s, "speculation": not a.no_speculation, "cells": {}}
    salt = 0
    sched, kinds = engine.scheduler, getattr(engine.model, "step_kinds", None)
    waits = a.prefill_wait or [sched.prefill_wait_steps]
    default_wait = sched.prefill_wait_steps
    res["paths"] = {}
    built_overlap, built_mixed = engine.overlap, getattr(engine.model, "mixed_graphs", None)
    cells = [(arrivals, wait, ov, mx) for arrivals in a.arrivals for wait in waits for ov in (a.overlap or [None])
             for mx in (a.mixed or [None])]
    for rep in range(a.repeats + 1):  # repeat 0: the warm-up
        for s in a.sampling:
            for b in a.batches:
                for arrivals, wait, ov, mx in cells:
                    n = b * a.per_client
                    _, texts = prompts("story", salt + n)  # fresh prompts every cell: no cached prefix carries over
                    ids = [bos + tokenizer.encode(t, add_special_tokens=False).ids for t in texts[salt:]]
                    salt += n
                    sched.prefill_wait_steps = wait
                    engine.overlap = built_overlap if ov is None else ov == "on"
                    if mx is not None:
                        engine.model.mixed_graphs = mx == "on"
                    before, held, ahead = dict(kinds or {}), sched.held_steps, engine.steps_ahead
                    generated, seconds = run_cell(engine, ids, b, a.per_client, a.tokens, SAMPLING[s],
                                                  f"r{rep}-{s}-b{b}-{arrivals}-w{wait}", arrivals == "staggered")
                    if generated != n * a.tokens:
                        raise RuntimeError(f"batch {b}: {generated} tokens generated, {n * a.tokens} asked for")
                    rate = generated / seconds
                    key = (f"{s}/b{b}" if arrivals == "together" and wait == default_wait
                           else f"{s}/b{b}/{arrivals}/w{wait}") + ("" if ov is None else f"/overlap-{ov}") + (
                        "" if mx is None else f"/mixed-{mx}")
                    paths = {k: v - before.get(k, 0) for k, v in (kinds or {}).items()}
                    paths["held"] = sched.held_steps - held
                    paths["ahead"] = engine.steps_ahead - ahead
                    if rep:
                        res["cells"].setdefault(key, []).append(rate)
                        res["paths"][key] = paths
                    print(f"{'warm-up' if not rep else f'repeat {rep}'} {key}: {rate:,.0f} tok/s, {seconds:.2f} s, "
                          f"steps {paths}", flush=True)
    sched.prefill_wait_steps, engine.overlap = default_wait, built_overlap
    if built_mixed is not None:
        engine.model.mixed_graphs = built_mixed
    res["cells"] = {k: {**spread(v), "samples": v} for k, v in res["cells"].items()}
    print(f"engine alone ({'adaptive speculation' if res['speculation'] else 'no speculation'}), setup {setup_s:.1f} s")
    for k, v in res["cells"].items():
        print(f"{k:28s} median {v['median']:10,.0f} tok/s  min {v['min']:10,.0f}  max {v['max']:10,.0f}  n={v['n']}  "
              f"last run's steps {res['paths'].get(k)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
