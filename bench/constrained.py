"""Constrained vs unconstrained decode throughput on Pulse's engine (issue 12), in process.

    python -m bench.constrained --batches 1 32 --tokens 48 --repeats 5 --warmup 2

For each batch size B, two configurations run interleaved (bench/protocol.py): B greedy sequences decoding
freely, and the same B decoding under a JSON schema (an array of records that cannot end before
`--tokens`, so both make the same number of tokens and the mask sees object/string/number transitions).
Only decode counts: the clock starts once every sequence has its first token (prefill done) and stops when
the last one finishes. `mask_ms_per_step` is the time spent computing and applying masks and advancing
the matchers, per decode step. Goal: constrained costs <= 20% of decode tok/s on the CPU path.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np

from bench import protocol
from bench.machine import machine_info

SCHEMA = ('{"type": "array", "minItems": 200, "items": {"type": "object", "properties": {'
          '"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, '
          '"city": {"type": "string", "maxLength": 16}}, "required": ["name", "age", "city"], '
          '"additionalProperties": false}}')
PROMPT = "<start_of_turn>user\nList people with their name, age and city as JSON.<end_of_turn>\n<start_of_turn>model\n"


class TimedConstraints:
    """The engine's Constraints with the time spent in them counted (what constraining costs per step)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.steps = inner, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __contains__(self, rid):
        return rid in self.inner

    def apply(self, logits, ids):
        t0 = time.perf_counter()
        out = self.inner.apply(logits, ids)
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        return out

    def advance(self, ids, tokens):
        t0 = time.perf_counter()
        self.inner.advance(ids, tokens)
        self.seconds += time.perf_counter() - t0


def build(max_batch: int):
    from workers.cupy.constrain import GrammarCompiler
    from workers.cupy.models import build_model
    from workers.cupy.ops import Ops
    from workers.cupy.weights import load_weights
    from workers.protocol.model import load_model_info, load_tokenizer

    info, tok = load_model_info(None), load_tokenizer(None)
    model = build_model(info, load_weights(info.path), Ops(np))
    compiler = GrammarCompiler(tok, info.vocab_size, info.eos_token_ids)
    compiler.ready()
    compiler.prepare(SCHEMA)
    prompt = [info.bos_token_id] + tok.encode(PROMPT, add_special_tokens=False).ids
    return info, model, compiler, prompt


def decode_run(setup, batch: int, tokens: int, constrained: bool, tag: str) -> dict:
    from workers.cupy.constrain import Constraints
    from workers.cupy.engine import create_engine
    from workers.protocol import GenerateRequest, SamplingParams

    info, model, compiler, prompt = setup
    blocks = batch * ((len(prompt) + tokens) // 16 + 2)
    engine = create_engine(info, None, np, block_size=16, num_blocks=blocks, max_num_seqs=batch,
                           max_step_tokens=max(2048, batch * len(prompt)), context_length=info.context_length,
                           model=model, seed=0)
    timed = engine.constraints = TimedConstraints(Constraints(compiler, np))
    for i in range(batch):
        engine.add(GenerateRequest(request_id=f"{tag}{i}", prompt_ids=prompt, max_tokens=tokens,
                                   sampling=SamplingParams(temperature=0.0), ignore_eos=not constrained,
                                   grammar=SCHEMA if constrained else None))
    started, made = set(), 0
    while len(started) < batch:  # prefill (not timed): every sequence gets its first token
        started |= {o.request_id for o in engine.step() if o.token_ids}
    timed.seconds, timed.steps = 0.0, 0
    t0 = time.perf_counter()
    while engine.has_work():
        made += sum(len(o.token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t0
    return {"decode_tok_s": made / elapsed, "step_ms": 1e3 * elapsed / max(1, tokens - 1),
            "mask_ms_per_step": 1e3 * timed.seconds / max(1, timed.steps) if constrained else None,
            "tokens": made}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per sequence")
    protocol.add_arguments(ap, Path("bench/results"))
    args = ap.parse_args(argv)
    machine = machine_info()
    setup = build(max(args.batches))
    measures = {}
    for b in args.batches:
        for constrained in (False, True):
            name = f"B{b}-{'schema' if constrained else 'free'}"
            measures[name] = _measure(setup, b, args.tokens, constrained, name)
    started = time.time()
    records = asyncio.run(protocol.run(measures, args.repeats, args.warmup, not args.quiet))
    summary = protocol.summarize(records)
    metrics = ["decode_tok_s", "step_ms", "mask_ms_per_step"]
    notes = _verdict(records, args.batches)
    doc = protocol.result_document("constrained", records, summary, vars(args) | {"out": str(args.out)}, started,
                                   machine)
    paths = protocol.write_result(doc, protocol.markdown_table(summary, metrics), metrics, args.out, notes)
    print(paths["md"].read_text())
    return 0


def _measure(setup, batch, tokens, constrained, name):
    async def measure():
        return decode_run(setup, batch, tokens, constrained, name)
    return measure


def _verdict(records, batches) -> str:
    """Per repeat, the constrained run's tok/s over the free run's of the same repeat (paired)."""
    lines = []
    for b in batches:
        ratios = [r[f"B{b}-schema"]["decode_tok_s"] / r[f"B{b}-free"]["decode_tok_s"]
                  for r in protocol.by_repeat(records).values()]
        s = protocol.spread(ratios)
        cost = 100 * (1 - s["median"])
        lines.append(f"B={b}: constrained/free tok/s per repeat: median {s['median']:.3f} "
                     f"(min {s['min']:.3f}, max {s['max']:.3f}) -> cost {cost:.1f}% "
                     f"({'meets' if cost <= 20 else 'misses'} the <= 20% CPU goal)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
