"""Which grammar library for constrained decoding: llguidance vs xgrammar vs outlines-core on the bundled
Gemma 3 vocabulary (262,144 tokens), on this machine (issue 12's choice, by measurement).

    pip install --no-deps --target /tmp/gramlibs xgrammar==0.2.8 outlines-core==0.2.14 apache-tvm-ffi
    PYTHONPATH=/tmp/gramlibs python -m bench.grammar_libs --libs llguidance xgrammar outlines_core

Per library, in its own process (so memory is its own): the vocabulary index build (once: ~10-20 s), the
compile of each schema (`--repeats` times, cold: no cache), and the per-step mask time while a reply that
follows the schema is fed token by token (median and max over the steps). Only llguidance is a Pulse
dependency; the other two are installed aside for this comparison (xgrammar also needs torch).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SCHEMAS = {
    "tool_call": {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street"]}}, "required": ["name", "age"]},
    "any_object": {"type": "object"},
}
REPLIES = {
    "tool_call": '{"name": "get_weather", "arguments": {"city": "Paris, France", "unit": "c", "days": 3}}',
    "person": '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], '
              '"address": {"street": "12 St James Square", "zip": "10001"}}',
    "any_object": '{"a": [1, 2, {"b": "some text here"}], "c": null, "d": true, "e": 3.25}',
}


def _llguidance(tok, info):
    import llguidance as llg
    import numpy as np

    lt = llg.LLTokenizer(tok.to_str(), n_vocab=info.vocab_size, eos_token=list(info.eos_token_ids))
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile_(schema):
        return llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=opts))

    def stepper(m):
        mask = np.zeros((info.vocab_size + 31) // 32, np.int32)
        return lambda: m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes), m.consume_token
    return compile_, stepper


def _xgrammar(tok, info):
    import transformers
    import xgrammar as xgr

    ti = xgr.TokenizerInfo.from_huggingface(transformers.PreTrainedTokenizerFast(tokenizer_object=tok),
                                            vocab_size=info.vocab_size, stop_token_ids=list(info.eos_token_ids))

    def compile_(schema):
        return xgr.GrammarMatcher(xgr.GrammarCompiler(ti, cache_enabled=False).compile_json_schema(
            json.dumps(schema), any_whitespace=False))

    def stepper(m):
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        return lambda: m.fill_next_token_bitmask(mask), m.accept_token
    return compile_, stepper


def _outlines_core(tok, info):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocab: dict[str, list[int]] = {}
    for tid in range(info.vocab_size):
        piece = tok.id_to_token(tid)
        if piece is not None and tid not in info.eos_token_ids:
            vocab.setdefault(piece.replace("\u2581", " "), []).append(tid)
    voc = Vocabulary(info.eos_token_ids[0], vocab)

    def compile_(schema):
        return Guide(Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=" ?"), voc))

    def stepper(g):
        def consume(t):
            g.advance(t)
            return True
        return g.get_tokens, consume
    return compile_, stepper


LIBS = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines_core": _outlines_core}


def measure_one(lib: str, repeats: int, max_compile_s: float) -> dict:
    from workers.protocol.model import load_model_info, load_tokenizer

    info, tok = load_model_info(None), load_tokenizer(None)
    t0 = time.perf_counter()
    compile_, stepper = LIBS[lib](tok, info)
    out = {"lib": lib, "index_build_s": time.perf_counter() - t0, "schemas": {}}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = compile_(schema)
            times.append(time.perf_counter() - t0)
            if sum(times) > max_compile_s:
                break
        fill, consume = stepper(matcher)
        steps = []
        for t in tok.encode(REPLIES[name], add_special_tokens=False).ids:
            t0 = time.perf_counter()
            fill()
            steps.append(time.perf_counter() - t0)
            if not consume(t):
                raise RuntimeError(f"{lib} refused token {t} of the {name} reply")
        out["schemas"][name] = {"compile_ms": [1e3 * x for x in times],
                                "mask_ms_median": 1e3 * statistics.median(steps), "mask_ms_max": 1e3 * max(steps),
                                "steps": len(steps)}
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def table(results: list[dict]) -> str:
    rows = ["| library | vocab index (s) | schema | compile ms: median (min–max), n | mask ms/step: median (max) | peak RSS MB |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for name, s in r["schemas"].items():
            c = s["compile_ms"]
            rows.append(f"| {r['lib']} | {r['index_build_s']:.1f} | {name} | {statistics.median(c):.1f} "
                        f"({min(c):.1f}–{max(c):.1f}), {len(c)} | {s['mask_ms_median']:.3f} ({s['mask_ms_max']:.1f}) "
                        f"| {r['max_rss_mb']:.0f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=list(LIBS))
    ap.add_argument("--repeats", type=int, default=5, help="compiles per schema")
    ap.add_argument("--max-compile-s", type=float, default=120.0, help="stop repeating a schema's compile after this")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one library in this process
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.repeats, args.max_compile_s)))
        return 0
    from bench.machine import describe, machine_info

    machine, results = machine_info(), []
    for lib in args.libs:
        proc = subprocess.run([sys.executable, "-m", "bench.grammar_libs", "--one", lib, "--repeats", str(args.repeats),
                               "--max-compile-s", str(args.max_compile_s)], capture_output=True, text=True)
        if proc.returncode:
            print(f"{lib} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"Machine: {describe(machine)}\n\n{table(results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
