"""Batch-1 decode speed of a running `pulse serve`, per served model, as a client sees it: what the device
profile's default backend is chosen by. One server can hold the same GGUF on both backends (a `models:` list
with a `backend` each), so the backends are measured in the same run, interleaved:

    pulse serve --config bench/backend_speed.yaml --port 8011 &
    python -m bench.backend_speed --base http://127.0.0.1:8011 --repeats 5

Each repeat streams one greedy chat answer of --tokens tokens (ignore_eos) per model, models in turn, and
times the tokens after the first (prefill left out) over the time from the first to the last; prints the
median and range per model.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def models(base: str) -> list[str]:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def decode_rate(base: str, model: str, tokens: int) -> float:
    body = json.dumps({"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    first = last = None
    generated = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                generated = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    if not generated or first is None or last == first:
        raise RuntimeError(f"{model}: no timed tokens")
    return (generated - 1) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    served = models(args.base)
    for model in served:
        decode_rate(args.base, model, 8)  # warm-up
    rates: dict[str, list[float]] = {m: [] for m in served}
    for _ in range(args.repeats):  # interleaved: a busy spell on a shared box hits every model alike
        for model in served:
            rates[model].append(decode_rate(args.base, model, args.tokens))
    for model, r in rates.items():
        print(f"{model}: {statistics.median(r):.1f} tok/s (range {min(r):.1f}-{max(r):.1f}, "
              f"{args.repeats} repeats of {args.tokens} tokens)", flush=True)

if __name__ == "__main__":
    main()
