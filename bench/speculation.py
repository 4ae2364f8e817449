"""Speculative decoding on Pulse's engine (issue 4), in process: the code-editing speedup at batch 1 and the
policy grid (context length x concurrency x K).

    python -m bench.speculation edit --tokens 48 --repeats 5 --warmup 2
    python -m bench.speculation grid --contexts 256 1024 --concurrency 1 4 --ks 2 4 --tokens 24
    python -m bench.speculation grid --workload chat ...   (open questions: little for prompt lookup to find)

`edit`: code-editing prompts (a source file plus an instruction to rewrite it with a small change), one at
a time (batch 1), greedy, three configurations interleaved: `none` (no speculation), `lookup` (prompt
lookup: the file is in the prompt) and `predicted` (OpenAI Predicted Outputs: the original file as the
prediction). K comes from the device profile's policy. Decode tok/s counts only decoding (the clock starts
at each request's first token), and every speculative run's tokens are compared with `none`'s:
`identical` is 1 when every prompt gave the same tokens. Goal on the GPU: >= 2.0x `none`'s tok/s.

`grid`: for each context length L and concurrency C, C streams each decode after an L-token code-editing
prompt (the prompts are cached in the engine's prefix cache before timing starts, so a run measures
decode), under fixed K (0 = always off; each --ks; the largest is "always on") and under the adaptive
policy (K per sequence per step from policy.speculation with the engine's live running count and the
device profile). Aggregate decode tok/s per cell; the notes say per cell which configuration won and the
adaptive one's tok/s over the best's, paired per repeat ('matches' only when that ratio's range includes 1.0
within 3%).

Each configuration keeps one Speculator per cell (per configuration in `edit`) across its warm-up and repeats, as
a server keeps one across requests: the adaptive policy's gate and acceptance prior are warm when the repeats run,
and the warm-up is its cold start. (Until 2026-12-07 each run made a new one, so every adaptive figure was a cold
start: a 16-step epoch with drafting off for the gate to measure, every draft position's estimate at 0.5; on an
H100 that read 0.55-0.87x of the best fixed K at 128 tokens a request, BENCHMARKS.md, issue 19.)

Runs unchanged on a GPU (`--device auto` picks CUDA when present: the engine is then the CuPy/CUDA one).
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np

from bench import protocol
from bench.machine import machine_info

MODEL: str | None = None  # the GGUF (--model); None: the bundled model package

SOURCES = {
    "geometry.py": '''import math


def area(width, height):
    """Area of a width x height rectangle."""
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def diagonal(width, height):
    return math.sqrt(width ** 2 + height ** 2)


def describe(width, height):
    return f"{width}x{height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
''',
    "inventory.py": '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if self.items.get(name, 0) < count:
            raise ValueError(f"not enough {name}")
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
''',
    "server.py": '''import json
from http.server import BaseHTTPRequestHandler, HTTPServer

PORT = 8080


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    HTTPServer(("", PORT), Handler).serve_forever()
''',
}
EDITS = {
    "geometry.py": "Rename the parameter `width` to `w` everywhere",
    "inventory.py": "Rename the method `total` to `count_all`",
    "server.py": "Change the port from 8080 to 9090",
}


def edit_prompt(name: str, source: str, instruction: str, preamble: str = "") -> str:
    return (f"<start_of_turn>user\n{preamble}{instruction} in this file and output the whole file.\n"
            f"```python\n# {name}\n{source}```<end_of_turn>\n<start_of_turn>model\n```python\n# {name}\n")


# --- the engine ----------------------------------------------------------------------------------------
def build_engine(device: str, max_num_seqs: int, kv_tokens: int, max_step_tokens: int):
    """Pulse's engine on `device` (auto: CUDA when present), as the worker builds it; and its device name."""
    from workers.cupy.device import array_module, device_name
    from workers.cupy.weights import load_weights
    from workers.protocol.model import load_model_info

    xp = array_module(device)
    info = load_model_info(MODEL)
    weights = load_weights(info.path)
    sizes = dict(block_size=16, num_blocks=kv_tokens // 16, max_num_seqs=max_num_seqs,
                 max_step_tokens=max_step_tokens, context_length=info.context_length, seed=0)
    if xp is np:
        from workers.cupy.engine import create_engine

        engine = create_engine(info, weights, np, **sizes)
    else:
        from workers.cupy.gpu import create_gpu_engine

        engine = create_gpu_engine(info, weights, **sizes)
    return engine, device_name(xp), info


def encode(info, text: str) -> list[int]:
    from workers.protocol.model import load_tokenizer

    return [info.bos_token_id] + load_tokenizer(MODEL).encode(text, add_special_tokens=False).ids


def fixed_k(k: int):
    from policy.profiles import DeviceProfile, SpeculationRule

    return DeviceProfile(name=f"fixed-{k}", max_draft_tokens=k, speculation=[SpeculationRule(max_context=10**9, k=k)],
                         speculation_gate=False)


def set_policy(engine, profile, kept: dict | None = None, key=None) -> None:
    """Speculation under `profile` (None: the plain engine, no speculator at all). With `kept`, the Speculator
    made for `key` the first time is used again (its gate and acceptance prior stay warm between runs)."""
    from workers.cupy.speculative import Speculator

    if profile is None:
        engine.speculator = None
    elif kept is None:
        engine.speculator = Speculator(profile, gate=profile.speculation_gate)
    else:
        if key not in kept:
            kept[key] = Speculator(profile, gate=profile.speculation_gate)
        engine.speculator = kept[key]


def decode(engine, requests) -> dict:
    """Run `requests` together; decode time counts from the step where the last one got its first token."""
    for r in requests:
        engine.add(r)
    tokens = {r.request_id: [] for r in requests}
    finals, t0 = {}, None
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finish_reason:
                finals[out.request_id] = out
        if t0 is None and all(tokens.values()):
            t0, first = time.perf_counter(), sum(len(t) for t in tokens.values())
    elapsed = time.perf_counter() - t0
    made = sum(len(t) for t in tokens.values()) - first
    drafted = sum(f.drafted_tokens for f in finals.values())
    accepted = sum(f.accepted_tokens for f in finals.values())
    return {"tokens": tokens, "seconds": elapsed, "made": made, "drafted": drafted, "accepted": accepted}


def request(rid: str, ids: list[int], tokens: int, prediction=None, temperature: float = 0.0, seed: int | None = None):
    from workers.protocol import GenerateRequest, SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=seed)
    return GenerateRequest(request_id=rid, prompt_ids=ids, max_tokens=tokens, sampling=sampling,
                           ignore_eos=True, prediction_ids=prediction)


# --- edit: batch-1 speedup ------------------------------------------------------------------------------
def edit_measures(engine, info, profile, tokens: int) -> dict:
    # the prediction is the original file: what the answer repeats after the "# name" line the prompt ends with
    prompts = [(encode(info, edit_prompt(n, s, EDITS[n])), encode(info, s)[1:]) for n, s in SOURCES.items()]
    reference: dict[int, list[int]] = {}
    counter = iter(range(10**9))
    kept: dict = {}

    def run(config: str) -> dict:
        set_policy(engine, None if config == "none" else profile, kept, config)
        secs = made = drafted = accepted = 0
        same = True
        for i, (ids, prediction) in enumerate(prompts):
            r = decode(engine, [request(f"{config}-{next(counter)}", ids, tokens,
                                        prediction if config == "predicted" else None)])
            out = next(iter(r["tokens"].values()))
            if config == "none":
                reference.setdefault(i, out)
            same &= reference.get(i, out) == out
            secs, made = secs + r["seconds"], made + r["made"]
            drafted, accepted = drafted + r["drafted"], accepted + r["accepted"]
        return {"decode_tok_s": made / secs, "acceptance": accepted / drafted if drafted else None,
                "drafted": drafted, "identical": float(same)}

    return {c: _async(run, c) for c in ("none", "lookup", "predicted")}


# --- grid: context x concurrency x K --------------------------------------------------------------------
PROSE = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain to a child why the sky is blue and why sunsets are red.",
         "Give three arguments for and against working from home.")


def grid_prompts(info, context: int, streams: int, workload: str = "code") -> list[list[int]]:
    """`streams` distinct prompts of `context` tokens: other files as preamble, cut to fit, then a code edit
    ("code": the answer repeats a file, drafts hold) or an open question ("chat": little to look up)."""
    from workers.protocol.model import load_tokenizer

    tok, names, out = load_tokenizer(MODEL), list(SOURCES), []
    for s in range(streams):
        target = names[s % len(names)]
        if workload == "chat":
            ask = f"<start_of_turn>user\n{PROSE[s % len(PROSE)]}<end_of_turn>\n<start_of_turn>model\n"
            edit = encode(info, ask)
        else:
            edit = encode(info, edit_prompt(target, SOURCES[target], EDITS[target]))
        filler, i = [], 0
        while len(filler) < context - len(edit):
            other = names[(s + i) % len(names)]
            text = f"Context file {i} ({other}), stream {s}:\n```python\n{SOURCES[other]}```\n"
            filler += tok.encode(text, add_special_tokens=False).ids
            i += 1
        out.append(edit[:1] + filler[: max(0, context - len(edit))] + edit[1:])
    return out


def grid_measures(engine, info, device_profile, contexts, concurrency, ks, tokens, workload="code",
                  temperature: float = 0.0) -> dict:
    """Each cell's requests at `temperature` (above 0: seeded by the stream's index, so every configuration
    samples the same tokens: the draws are keyed by seed and position, whatever speculation does)."""
    configs = {"off": None, **{f"k{k}": fixed_k(k) for k in ks}, "adaptive": device_profile}
    measures, counter, kept = {}, iter(range(10**9)), {}
    for context in contexts:
        for streams in concurrency:
            prompts = grid_prompts(info, context, streams, workload)
            set_policy(engine, None)
            decode(engine, [request(f"warm-{next(counter)}", p, 1) for p in prompts])  # into the prefix cache
            for name, profile in configs.items():
                def run(profile=profile, prompts=prompts, key=(context, streams, name)):
                    set_policy(engine, profile, kept, key)
                    r = decode(engine, [request(f"g{next(counter)}", p, tokens, temperature=temperature,
                                                seed=i if temperature > 0 else None) for i, p in enumerate(prompts)])
                    return {"decode_tok_s": r["made"] / r["seconds"],
                            "acceptance": r["accepted"] / r["drafted"] if r["drafted"] else None}
                measures[f"L{context}-C{streams}-{name}"] = _async(run)
    return measures


def _async(fn, *args):
    async def measure():
        return fn(*args)
    return measure


# --- verdicts --------------------------------------------------------------------------------------------
def edit_notes(records) -> str:
    lines = []
    for config in ("lookup", "predicted"):
        ratios = [r[config]["decode_tok_s"] / r["none"]["decode_tok_s"] for r in protocol.by_repeat(records).values()]
        same = all(r[config]["identical"] == 1.0 for r in protocol.by_repeat(records).values())
        s = protocol.spread(ratios)
        lines.append(f"{config} vs none, tok/s per repeat: median {s['median']:.2f}x (min {s['min']:.2f}, max "
                     f"{s['max']:.2f}); tokens identical to none in every repeat: {'yes' if same else 'NO'}")
    return "\n".join(lines)


MATCH_TOLERANCE = 0.03  # a paired ratio within 3% of 1.0 counts as equal speed


def paired_verdict(ratios: list[float], tolerance: float = MATCH_TOLERANCE) -> str:
    """'matches' only when the per-repeat ratios' range includes 1.0 within `tolerance`, else the median
    ratio with its range: two overlapping min-max ranges of noisy repeats are not a match."""
    s = protocol.spread(ratios)
    if s["min"] <= 1.0 + tolerance and s["max"] >= 1.0 - tolerance:
        return f"matches ({s['median']:.2f}x, {s['min']:.2f}-{s['max']:.2f})"
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def grid_notes(records, summary, contexts, concurrency, ks) -> str:
    """Per cell: each configuration's median tok/s, the best fixed one, and adaptive / best paired per
    repeat (the same repeat ran both, so machine drift cancels)."""
    names = ["off", *[f"k{k}" for k in ks], "adaptive"]
    head = "| L | C | " + " | ".join(names) + " | best fixed | adaptive / best, per repeat |"
    rows = [head, "| --- " * (len(names) + 4) + "|"]
    totals = {n: 0.0 for n in names}
    repeats = protocol.by_repeat(records).values()
    for context in contexts:
        for streams in concurrency:
            key = f"L{context}-C{streams}-"
            cell = {n: summary[key + n]["decode_tok_s"] for n in names}
            for n in names:
                totals[n] += cell[n]["median"]
            best = max((n for n in names if n != "adaptive"), key=lambda n: cell[n]["median"])
            ratios = [r[key + "adaptive"]["decode_tok_s"] / r[key + best]["decode_tok_s"] for r in repeats]
            rows.append(f"| {context} | {streams} | " + " | ".join(f"{cell[n]['median']:.1f}" for n in names)
                        + f" | {best} | {paired_verdict(ratios)} |")
    rows.append("\nSum of cell medians (tok/s): " + ", ".join(f"{n} {v:.1f}" for n, v in totals.items()))
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["edit", "grid"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled model package)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024], help="grid: prompt tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="grid: streams at once")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4], help="grid: fixed K values besides 0")
    ap.add_argument("--workload", default="code", choices=["code", "chat"], help="grid: what the prompts ask")
    ap.add_argument("--temperature", type=float, default=0.0, help="grid: the requests' temperature (0: greedy; "
                    "1: OpenAI's default, no top_k/top_p), seeded per stream")
    ap.add_argument("--profile", default=None, help="device profile for the adaptive policy (default: by device)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads on the CPU path (the worker's default)")
    protocol.add_arguments(ap, Path("bench/results"))
    args = ap.parse_args(argv)
    global MODEL
    MODEL = args.model
    from threadpoolctl import threadpool_limits

    from policy.profiles import builtin_profiles, select_profile

    threadpool_limits(limits=args.threads, user_api="blas")
    machine = machine_info()
    biggest = max(args.contexts) if args.part == "grid" else 1024
    streams = max(args.concurrency) if args.part == "grid" else 1
    # every cell's prompts stay in the prefix cache while the cells interleave
    cached = sum(args.concurrency) * sum(c + args.tokens + 64 for c in args.contexts) if args.part == "grid" else 4096
    engine, dev, info = build_engine(args.device, max(streams, 1), kv_tokens=int(1.25 * cached) + 4096,
                                     max_step_tokens=max(2048, biggest + 64))
    profile = select_profile(dev, builtin_profiles(), args.profile)
    if args.part == "edit":
        measures = edit_measures(engine, info, profile, args.tokens)
    else:
        measures = grid_measures(engine, info, profile, args.contexts, args.concurrency, args.ks, args.tokens,
                                 args.workload, args.temperature)
    started = time.time()
    records = asyncio.run(protocol.run(measures, args.repeats, args.warmup, not args.quiet))
    summary = protocol.summarize(records)
    metrics = ["decode_tok_s", "acceptance"] + (["identical"] if args.part == "edit" else [])
    notes = f"Device: {dev}; adaptive policy: profile `{profile.name}`.\n\n" + (
        edit_notes(records) if args.part == "edit" else grid_notes(records, summary, args.contexts, args.concurrency, args.ks))
    name = f"speculation-{args.part}" + (f"-{args.workload}" if args.part == "grid" else "") + (
        f"-t{args.temperature:g}" if args.part == "grid" and args.temperature else "")
    doc = protocol.result_document(name, records, summary,
                                   vars(args) | {"out": str(args.out), "device": dev, "profile": profile.name}, started,
                                   machine)
    paths = protocol.write_result(doc, protocol.markdown_table(summary, metrics), metrics, args.out, notes)
    print(paths["md"].read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
