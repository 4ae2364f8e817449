"""The engine's NumPy (CPU) path speed, through the whole engine (scheduler, paged KV, sampler).

    python -m bench.engine_cpu --repeats 5 [--threads 1] [--llama-threads 1 2] [--json out.json] [--model M]

Cases, interleaved in every repeat after one discarded warm-up round (order rotated per repeat):
- prefill: one 512-token prompt in one step, prompt tokens/s;
- decode b1: one sequence, 64 greedy tokens after a short prompt, tokens/s of the decode steps;
- decode b8: eight sequences at once, 32 greedy tokens each, aggregate tokens/s of the decode steps.
Reports median, min and max over the repeats, with the machine's load average beside them. Each case
is given twice: per wall-clock second, and per second of this process' CPU time (tokens over
time.process_time), which a shared, loaded box distorts far less than wall time.
With --llama-threads, llama.cpp's CPU build runs the same cases (same prompt token ids) in the same rounds,
one llama-server per thread count (bench/llama_cpu.py says how it is driven and timed), and the table gives
the engine / llama.cpp ratio per case, paired within each repeat.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

from bench.llama_cpu import LlamaCpu
from bench.machine import describe, machine_info
from bench.protocol import by_repeat, command_line, schedule, spread, summarize
from workers.cupy.engine import create_engine
from workers.cupy.models import build_model
from workers.cupy.ops import Ops
from workers.cupy.weights import load_weights
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info

GREEDY = SamplingParams(temperature=0.0)


def decode_prompts(info, n_seqs: int) -> list[list[int]]:
    """The decode cases' prompts: BOS + 15 random ids each (the same for the engine and llama.cpp)."""
    rng = np.random.default_rng(n_seqs)
    return [[info.bos_token_id] + rng.integers(1000, min(100_000, info.vocab_size), 15).tolist()
            for _ in range(n_seqs)]


def prefill_prompt(info, n_tokens: int = 512) -> list[int]:
    high = min(100_000, info.vocab_size)
    return [info.bos_token_id] + np.random.default_rng(0).integers(1000, high, n_tokens - 1).tolist()


def decode_rate(model, info, n_seqs: int, n_tokens: int) -> tuple[float, float]:
    """Aggregate generated tokens/s over the steps after the prefill step (wall, process CPU)."""
    engine = _engine(model, info, n_seqs)
    for i, prompt in enumerate(decode_prompts(info, n_seqs)):
        engine.add(GenerateRequest(request_id=f"d{i}", prompt_ids=prompt, max_tokens=n_tokens, sampling=GREEDY,
                                   ignore_eos=True))
    engine.step()  # every prompt prefills in this first step
    generated, t0, c0 = 0, time.perf_counter(), time.process_time()
    while engine.has_work():
        generated += len(engine.step())
    return generated / (time.perf_counter() - t0), generated / (time.process_time() - c0)


def prefill_rate(model, info, n_tokens: int = 512) -> tuple[float, float]:
    engine = _engine(model, info, 1)
    prompt = prefill_prompt(info, n_tokens)
    engine.add(GenerateRequest(request_id="p", prompt_ids=prompt, max_tokens=1, sampling=GREEDY))
    t0, c0 = time.perf_counter(), time.process_time()
    engine.step()
    return n_tokens / (time.perf_counter() - t0), n_tokens / (time.process_time() - c0)


def _engine(model, info, n_seqs: int):
    return create_engine(info, None, np, block_size=16, num_blocks=256, max_num_seqs=n_seqs,
                         max_step_tokens=2048, context_length=4096, model=model)


# case: (the engine's measure, llama.cpp's measure on one server), both on the same prompt token ids
CASES = {
    "prefill 512 (tok/s)": (lambda m, i: prefill_rate(m, i),
                            lambda srv, i: srv.prefill(prefill_prompt(i))),
    "decode b1 (tok/s)": (lambda m, i: decode_rate(m, i, 1, 64),
                          lambda srv, i: srv.decode(decode_prompts(i, 1), 64)),
    "decode b8 (aggregate tok/s)": (lambda m, i: decode_rate(m, i, 8, 32),
                                    lambda srv, i: srv.decode(decode_prompts(i, 8), 32)),
}
ENGINE = "engine"
CLOCKS = ("wall", "cpu")


def _measures(model, info, servers, loop) -> dict:
    """{"<system> | <case>": () -> {"wall": tok/s, "cpu": tok/s, ...}} for the engine and every server."""
    out = {}
    for case, (engine_fn, llama_fn) in CASES.items():
        out[f"{ENGINE} | {case}"] = lambda f=engine_fn: dict(zip(CLOCKS, f(model, info)))
        for srv in servers:
            out[f"{srv.name} | {case}"] = lambda f=llama_fn, s=srv: loop.run_until_complete(f(s, info))
    return out


def _rounds(measures: dict, repeats: int) -> tuple[list[dict], list[float]]:
    """One discarded warm-up round, then `repeats` rounds, every configuration once per round, order rotated."""
    records, loads = [], []
    for step in schedule(list(measures), repeats, warmup=1):
        records.append({"phase": step.phase, "repeat": step.repeat, "config": step.config,
                        "metrics": measures[step.config]()})
        loads.append(os.getloadavg()[0])
    return records, loads


def _ratios(records: list[dict], servers) -> dict:
    """{case: {server: {clock: spread of engine / server}}}, paired within each measured repeat."""
    rounds = by_repeat(records).values()
    return {case: {srv.name: {clock: spread([r[f"{ENGINE} | {case}"][clock] / r[f"{srv.name} | {case}"][clock]
                                             for r in rounds]) for clock in CLOCKS}
                   for srv in servers} for case in CASES}


def _cell(s: dict, digits: int) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(summary: dict, ratios: dict, names: list[str]) -> str:
    head = ["case", "clock", ENGINE] + [c for n in names for c in (n, f"{ENGINE} / {n}")]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for case in CASES:
        for clock in CLOCKS:
            cells = [case, "per wall s" if clock == "wall" else "per CPU s",
                     _cell(summary[f"{ENGINE} | {case}"][clock], 1)]
            for n in names:
                cells += [_cell(summary[f"{n} | {case}"][clock], 1), _cell(ratios[case][n][clock], 2)]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (the engine's default is 1)")
    ap.add_argument("--llama-threads", type=int, nargs="*", default=[],
                    help="also run llama.cpp's CPU build, one llama-server per thread count given (-t N)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--model", help="a GGUF path or bundled model name (default: the bundled Gemma 3 270M)")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=args.threads, user_api="blas")
    machine = describe(machine_info())  # before the run: its load average is the one at the start
    info = load_model_info(args.model)
    model = build_model(info, load_weights(info.path), Ops(np))
    loop = asyncio.new_event_loop()
    servers = [LlamaCpu(info.path, t) for t in args.llama_threads]
    try:
        for srv in servers:
            loop.run_until_complete(srv.start())
        records, loads = _rounds(_measures(model, info, servers, loop), args.repeats)
    finally:
        for srv in servers:
            loop.run_until_complete(srv.stop())
        loop.close()
    summary = summarize(records)
    result = {
        "command": command_line(), "machine": machine,
        "load_average_1m": spread(loads), "blas_threads": args.threads, "llama_threads": args.llama_threads,
        "summary": summary, "ratios": _ratios(records, servers), "records": records,
    }
    print(markdown(summary, result["ratios"], [s.name for s in servers]))
    print(f"`{result['command']}`; machine: {result['machine']}; BLAS threads {args.threads}; "
          f"load average (1 min, per measurement) {_cell(result['load_average_1m'], 1)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
