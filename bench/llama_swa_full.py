"""llama-server with and without `--swa-full` on a sliding-window model (Gemma 3): what a returning request's
prompt costs and what a decoded token costs, by context length, and aggregate tok/s under concurrent clients
(issue 18: the launch step's context checkpoints).

Without `--swa-full` llama-server keeps only the window of Gemma 3's sliding-window layers, so it cannot roll
a slot back by even one token without a context checkpoint: it splits every prompt's last tokens into extra
batches to create checkpoints (4 + n_ubatch and 4 tokens before the end) and restores one when a request
returns, re-processing what follows it. With `--swa-full` those layers keep full-size KV: no checkpoints, any
cached prefix is reused, but their attention reads the whole context instead of the window.

One llama-server at a time (the variants alternate, their order rotated per repeat, a fresh server each time),
the same binary, model and flags but the variant's. Per variant and repeat:
- for each `--contexts` length N, one client: a prompt of N tokens sent once (cached), then `--turns` times
  `retry`: the same prompt plus 8 new tokens, the last answer dropped (a retry, or an agent re-sending its
  context with a new tool result), and `--turns` times `next`: the prompt, its answer and 8 new tokens (a
  conversation going on), `--tokens` generated each: llama-server's own `timings` (prompt_ms: the request's
  prompt processing, its first token's cost; predicted_per_token_ms: decode) — the server's time, not served
  time;
- for each `--clients` C: C clients at once, each its own 32-token prompt, `--rounds` requests each
  returning to its prompt (+8 tokens a round): aggregate generated tok/s over the wall clock, and the
  requests' prompt_ms p50.
Prints median (min–max) over the repeats.

    python -m bench.llama_swa_full --binary ~/.cache/pulse/llama.cpp/11434.0.0/bin/llama-server \\
        --args "-np 4 -c 32768 --kv-unified -t 2" --contexts 512 4000 12000 --clients 4 --repeats 3
    # the GPU (bench/gpu_swa_full.sh): the h200 profile's flags, -np 64 -c 65536
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.llama_server_gap import prompt_ids as prompt
from bench.procs import Proc, free_port

VARIANTS = {"window": [], "swa-full": ["--swa-full"]}


def post(port: int, body: dict, timeout: float = 900.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def body(ids: list[int], n: int) -> dict:
    return {"prompt": ids, "n_predict": n, "temperature": 0, "cache_prompt": True, "ignore_eos": True}


def one_run(port: int, contexts: list[int], clients: list[int], tokens: int, turns: int, rounds: int,
            salt: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for n in contexts:
        ids = prompt(n, salt * 1000 + n)
        post(port, body(ids, 1))  # the first visit: cached from here on
        pm, dm = [], []
        for t in range(turns):  # back to the same prompt with a new message: the last answer dropped
            r = post(port, body(ids + prompt(9, salt * 1000 + n + 7 * t + 1)[1:], tokens))
            pm.append(r["timings"]["prompt_ms"])
            dm.append(r["timings"]["predicted_per_token_ms"])
        out[f"ctx{n}_retry_prompt_ms"] = statistics.median(pm)
        out[f"ctx{n}_decode_ms"] = statistics.median(dm)
        pm, convo = [], list(ids)
        for t in range(turns):  # the conversation goes on: the prompt, its answer, a new message
            convo += prompt(9, salt * 1000 + n + 7 * t + 3)[1:]
            r = post(port, {**body(convo, tokens), "return_tokens": True})
            convo += r["tokens"]
            pm.append(r["timings"]["prompt_ms"])
        out[f"ctx{n}_next_prompt_ms"] = statistics.median(pm)
    for c in clients:
        bases = [prompt(32, salt * 1000 + 500 + i) for i in range(c)]

        def client(i: int) -> tuple[int, list[float]]:
            got, pms = 0, []
            for k in range(rounds):
                r = post(port, body(bases[i] + prompt(9, salt * 1000 + 900 + 13 * i + k)[1:], tokens))
                got += r["tokens_predicted"]
                pms.append(r["timings"]["prompt_ms"])
            return got, pms

        with ThreadPoolExecutor(c) as pool:
            list(pool.map(lambda b: post(port, body(b, 1)), bases))  # first visits, untimed
            t0 = time.perf_counter()
            done = list(pool.map(client, range(c)))
            wall = time.perf_counter() - t0
        out[f"c{c}_tok_s"] = sum(g for g, _ in done) / wall
        out[f"c{c}_prompt_ms_p50"] = statistics.median([p for _, pms in done for p in pms])
    return out


def cell(values: list[float]) -> str:
    v = sorted(values)
    digits = 0 if v[len(v) // 2] >= 100 else 1 if v[len(v) // 2] >= 10 else 2
    return f"{statistics.median(v):.{digits}f} ({v[0]:.{digits}f}–{v[-1]:.{digits}f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", required=True, help="a GGUF with sliding-window layers (Gemma 3)")
    ap.add_argument("--args", default="", help="llama-server flags both variants get")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 512, 4000, 16000])
    ap.add_argument("--clients", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated a request")
    ap.add_argument("--turns", type=int, default=3, help="returning requests a context, one client")
    ap.add_argument("--rounds", type=int, default=3, help="requests a client under concurrency")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-dir", default=None, help="llama-server's output, a file a run (default: a temporary folder)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None, help="write every run here")
    a = ap.parse_args(argv)
    if "--swa-full" in shlex.split(a.args):
        ap.error("--args must not hold --swa-full: it is what the variants set apart")
    from bench.machine import describe, machine_info
    info = machine_info()
    print(f"`python -m bench.llama_swa_full {' '.join(shlex.quote(x) for x in (argv or sys.argv[1:]))}`")
    print(f"Machine: {describe(info)}")
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="swa-full-"))
    try:  # SIGINT (e.g. `timeout --signal=INT`) ends the run early: the repeats both variants finished still count
        for rep in range(a.repeats):
            for v in names[rep % 2:] + names[:rep % 2]:  # the order alternates per repeat
                port = free_port()
                with Proc(f"llama-server-{v}-{rep}", [a.binary, "-m", a.model, "--host", "127.0.0.1", "--port",
                                                      str(port), *shlex.split(a.args), *VARIANTS[v]], log_dir) as p:
                    p.wait_healthy(f"http://127.0.0.1:{port}/health", a.start_timeout)
                    r = one_run(port, a.contexts, a.clients, a.tokens, a.turns, a.rounds, rep)
                runs[v].append(r)
                print(f"repeat {rep} {v}: " + ", ".join(f"{k} {x:.1f}" for k, x in r.items()), flush=True)
    except KeyboardInterrupt:
        print("interrupted: the table has the repeats both variants finished", flush=True)
    done = min(len(r) for r in runs.values())
    if not done:
        return 1
    runs = {v: r[:done] for v, r in runs.items()}
    print(f"llama-server logs: {log_dir}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": argv or sys.argv[1:], "machine": info, "runs": runs}, f, indent=1)
    print("\n| measure | window (as released) | --swa-full | swa-full / window |\n| --- | --- | --- | --- |")
    for key in runs["window"][0]:
        w = [r[key] for r in runs["window"]]
        s = [r[key] for r in runs["swa-full"]]
        print(f"| {key} | {cell(w)} | {cell(s)} | {statistics.median(s) / statistics.median(w):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
