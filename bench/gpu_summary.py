"""Summarise bench/gpu_session.sh's rounds (round 0 is the discarded warm-up) into one JSON and a table.

    python bench/gpu_summary.py RESULTS_DIR ROUNDS OUT.json
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def stats(xs: list[float]) -> dict:
    xs = [float(x) for x in xs]
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def llama_bench(path: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"pp512": [], "tg128": []}
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError):
        return out
    for run in runs:
        key = f"pp{run['n_prompt']}" if run.get("n_prompt") else f"tg{run['n_gen']}"
        out.setdefault(key, []).extend(run.get("samples_ts") or [run["avg_ts"]])
    return out


def batched_bench(path: Path) -> dict[int, float]:
    out = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "pl" in row and "speed_tg" in row:
            out[int(row["pl"])] = float(row["speed_tg"])
    return out


def main() -> None:
    res, rounds, out_path = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    pulse: dict[str, list[float]] = {}
    lb: dict[str, list[float]] = {}
    lbb: dict[int, list[float]] = {}
    models: set[str] = set()
    for r in range(1, rounds + 1):  # round 0: warm-up, discarded
        try:
            p = json.loads((res / f"pulse_{r}.json").read_text())
        except (OSError, ValueError):
            p = {}
        if "model" in p:
            models.add(p["model"])
        for k, v in p.items():
            if isinstance(v, dict) and "samples" in v:
                pulse.setdefault(k, []).extend(v["samples"])
        for k, v in llama_bench(res / f"lb_{r}.json").items():
            lb.setdefault(k, []).extend(v)
        for pl, v in batched_bench(res / f"lbb_{r}.jsonl").items():
            lbb.setdefault(pl, []).append(v)
    summary = {"model": sorted(models), "pulse": {k: stats(v) for k, v in pulse.items()},
               "llama_bench": {k: stats(v) for k, v in lb.items()},
               "llama_batched_bench_tg": {str(k): stats(v) for k, v in lbb.items()}}
    rows = [
        ("prefill 512 tok (runner, device time)", "prefill_512", lb.get("pp512"), 1.0),
        ("prefill 512 tok (engine, wall to 1st token)", "engine_prefill_512", lb.get("pp512"), 1.0),
        ("decode batch 1 (runner)", "decode_b1", lb.get("tg128"), 2.0),
        ("decode batch 1 (engine)", "engine_decode_b1", lb.get("tg128"), 2.0),
        ("decode 64 seqs aggregate (runner)", "decode_b64", lbb.get(64), 1.5),
        ("decode 64 seqs aggregate (engine)", "engine_decode_b64", lbb.get(64), 1.5),
    ]
    print("model:", ", ".join(sorted(models)) or "unknown (no Pulse result read)")
    table = []
    for name, key, ref, goal in rows:
        p, q = stats(pulse.get(key, [])), stats(ref or [])
        ratio = p["median"] / q["median"] if q["n"] and p["n"] else float("nan")
        table.append({"case": name, "pulse": p, "llama_cpp": q, "ratio": ratio, "goal": goal})
        print(f"{name:44s} pulse {p['median']:9.0f} [{p['min']:.0f}-{p['max']:.0f}] n={p['n']:2d}  "
              f"llama.cpp {q['median']:9.0f} [{q['min']:.0f}-{q['max']:.0f}] n={q['n']:2d}  "
              f"ratio {ratio:5.2f} (goal {goal})")
    summary["table"] = table
    Path(out_path).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
