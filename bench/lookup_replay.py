"""Prompt lookup replayed on the model's own outputs: how many steps verify a draft, how many search and find
nothing, how many decode without searching, and what that would cost at a device's step times.

The bundled model generates each served workload's prompts (bench/served.py's `prompts`: code edits and story text)
on the CPU engine without speculation, greedy and at temperature 1 (seeded). Draws are keyed by seed and position
(workers/cupy/rng.py), so a draft token is kept exactly when it equals the token the output has there: the replay
is the engine's speculation on those requests, without the engine. Policies: the drafter (workers/cupy/drafter.py)
asked every step (`--waits 0`), or after a search that found nothing waiting 1, 2, 4, ... steps up to W before the
next (workers/cupy/speculative.py's MISS_WAIT_MAX), the steps between decoding without a search. Depth: always K
(the acceptance-aware depth and the speculation gate are left out). Step costs (`--costs`, ms at one stream):
decoding overlapped with the step before (a step that will not draft is launched ahead), decoding one step at a time
(a step whose search found nothing: it could not be launched ahead), verifying a draft. Prints, per workload and
sampling, the estimated speed against speculation off (every step overlapped) for each policy, and the step counts.

    python -m bench.lookup_replay                          # ~1.5 min on the dev box
    python -m bench.lookup_replay --costs 0.88 1.10 1.95 --waits 0 1 2 4 8 --k 8
"""
from __future__ import annotations

import argparse
import sys
import time

from bench.machine import describe, machine_info


def generate(workloads, samplings, streams: int, tokens: int) -> dict:
    """{(workload, sampling): [(prompt ids, output ids)]} from the CPU engine, speculation off."""
    from bench import speculation as spec
    from bench.served import prompts as served_prompts
    from workers.protocol import GenerateRequest, SamplingParams
    from workers.protocol.model import load_tokenizer

    engine, _, info = spec.build_engine("cpu", streams, 1 << 15, 2048)
    tok = load_tokenizer(spec.MODEL)
    out = {}
    for workload in workloads:
        _, texts = served_prompts(workload, streams)
        prompts = [[info.bos_token_id] + tok.encode(t, add_special_tokens=False).ids for t in texts]
        for sampling in samplings:
            temperature = 1.0 if sampling == "t1" else 0.0
            reqs = [GenerateRequest(request_id=f"{workload}-{sampling}-{i}", prompt_ids=p, max_tokens=tokens,
                                    sampling=SamplingParams(temperature=temperature, seed=i), ignore_eos=True)
                    for i, p in enumerate(prompts)]
            r = spec.decode(engine, reqs)
            out[(workload, sampling)] = [(p, r["tokens"][q.request_id]) for p, q in zip(prompts, reqs)]
    return out


def replay(prompt: list[int], output: list[int], k: int, wait_max: int) -> dict:
    """Step counts of one request: `verify` (a draft checked), `missed` (a search found nothing), `plain` (no
    search: waiting after misses)."""
    from workers.cupy.drafter import Drafter
    from workers.cupy.speculative import miss_wait

    drafter, seq, i = Drafter(None, len(prompt)), list(prompt), 0
    steps, wait, misses = {"verify": 0, "missed": 0, "plain": 0}, 0, 0
    while i < len(output):
        if wait:
            wait -= 1
            steps["plain"] += 1
            seq.append(output[i])
            i += 1
            continue
        draft = drafter.propose(seq, min(k, len(output) - i - 1))
        if not draft:
            steps["missed"] += 1
            seq.append(output[i])
            i += 1
            misses += 1
            wait = miss_wait(misses, wait_max)
            continue
        misses = kept = 0
        while kept < len(draft) and draft[kept] == output[i + kept]:
            kept += 1
        taken = output[i : i + kept + 1]
        seq += taken
        i += len(taken)
        steps["verify"] += 1
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["code", "story"], choices=["code", "story"])
    ap.add_argument("--sampling", nargs="+", default=["greedy", "t1"], choices=["greedy", "t1"])
    ap.add_argument("--streams", type=int, default=4, help="requests per workload and sampling")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--waits", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="the wait caps to replay")
    ap.add_argument("--costs", type=float, nargs=3, default=[0.88, 1.10, 1.95], metavar=("OVERLAPPED", "IN_ORDER",
                    "VERIFY"), help="ms a step (default: one stream on the H100, served, 2026-12-07: an estimate)")
    args = ap.parse_args(argv)
    print(describe(machine_info()))
    t0 = time.time()
    outputs = generate(args.workloads, args.sampling, args.streams, args.tokens)
    print(f"outputs generated in {time.time() - t0:.0f} s (CPU engine, speculation off)\n")
    overlapped, in_order, verify = args.costs
    print("| workload | sampling | tokens | " + " | ".join(f"wait ≤ {w}: x off (verify / missed / plain steps)"
                                                     for w in args.waits) + " |")
    print("|" + " --- |" * (3 + len(args.waits)))
    for (workload, sampling), pairs in outputs.items():
        n = sum(len(o) for _, o in pairs)
        cells = []
        for w in args.waits:
            total = {"verify": 0, "missed": 0, "plain": 0}
            for prompt, output in pairs:
                for key, count in replay(prompt, output, args.k, w).items():
                    total[key] += count
            ms = total["verify"] * verify + total["missed"] * in_order + total["plain"] * overlapped
            cells.append(f"{n * overlapped / ms:.2f}x ({total['verify']} / {total['missed']} / {total['plain']})")
        print(f"| {workload} | {sampling} | {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
