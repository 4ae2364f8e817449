"""The real backends' fuzz (tests/integration/test_fuzz_engine.py) at full count, several processes at once
against one `pulse serve`: what makes 10,000 requests a backend fit in minutes on a GPU box.

    python -m bench.fuzz_shards --backend cupy --examples 5000 --shards 8 --out /tmp/fuzz
    python -m bench.fuzz_shards --backend llama-server --binary BIN --examples 5000 --shards 8 --out /tmp/fuzz

Starts `pulse serve` with one worker of --backend on the box's default profile (a GPU box: the engine on the
GPU, llama-server with every layer there; --model a GGUF path, else the bundled Gemma; on a CPU box the same
small engine/llama-server settings the test module uses), then runs the test module in --shards pytest
processes at once, each with its own hypothesis seed and --examples / --shards examples per endpoint (chat and
completions), pointed at that server (PULSE_FUZZ_BASE). Each example is one request; so the requests per
backend are 2 x --examples. A shard passes when every answer was a 200 with a complete result or an
OpenAI-shaped 4xx, with no 5xx and no request over 120 s. Prints per shard and in total: the requests sent by
status, the slowest request, the shards' exit codes, and the server log's tracebacks; writes fuzz-<backend>.json
to --out. Exit status 0 only when every shard passed and the server stayed up.

Hypothesis draws independently in each shard (different seeds), so shards overlap only by chance; the shared
server sees the requests concurrently, which the one-process run (bench/fuzz_engine.sh) never did.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench.machine import REPO, machine_info
from bench.procs import Proc, free_port, owned_processes, python_module

TEST = "tests/integration/test_fuzz_engine.py"


def config(args, port: int, log_dir: Path) -> Path:
    from tests.integration import test_fuzz_engine as fuzz

    cfg: dict = {"server": {"port": port, "host": "127.0.0.1"}, "keys": {"file": str(log_dir / "keys.json")},
                 "telemetry": {"log_level": "WARNING"}, "model": {"name": fuzz.MODEL}}
    if args.model:
        cfg["model"]["path"] = args.model
    if args.backend == "cupy":
        workers: dict = {"backend": "cupy", "count": args.workers, "engine": {"device": args.device}}
        if args.device == "cpu":  # the test module's own small engine
            workers["engine"].update(kv_blocks=512, max_num_seqs=4)
    else:
        ls: dict = {"binary": args.binary, "log_dir": str(log_dir)}
        if args.device == "cpu":
            ls.update(slots=2, kv_tokens=4096, threads=2)
        workers = {"backend": "llama-server", "count": args.workers, "llama_server": ls}
    cfg["workers"] = workers
    path = log_dir / "pulse.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def run(args) -> dict:
    log_dir = args.out / f"fuzz-{args.backend}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    per_shard = -(-args.examples // args.shards)
    with owned_processes() as procs:
        server = Proc("pulse", python_module("pulse.cli", "serve", "--config", str(config(args, port, log_dir))),
                      log_dir)
        procs.append(server)
        base = f"http://127.0.0.1:{port}"
        server.wait_healthy(base + "/health", args.start_timeout)
        started = time.monotonic()
        shards = []
        for i in range(args.shards):
            tally = log_dir / f"tally-{i}.json"
            env = {**os.environ, "PULSE_FUZZ_BASE": base, "PULSE_FUZZ_BACKENDS": args.backend,
                   "PULSE_FUZZ_TALLY": str(tally), "PULSE_ENGINE_FUZZ_EXAMPLES": str(per_shard)}
            argv = [sys.executable, "-m", "pytest", TEST, "-q", "-p", "no:cacheprovider", "-x",
                    f"--hypothesis-seed={args.seed + i}", f"--timeout={args.timeout}"]
            argv += ["-k", f"test_fuzz_engine_{args.only}"] if args.only else []
            log = open(log_dir / f"shard-{i}.log", "wb")
            shards.append((subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), tally, log))
        codes = []
        for popen, _, log in shards:
            codes.append(popen.wait())
            log.close()
        wall = time.monotonic() - started
        alive = server.popen.poll() is None
    statuses: dict[str, Counter] = {}
    slowest: dict[str, int] = {}
    for _, tally, _ in shards:
        got = json.loads(tally.read_text()) if tally.exists() else {}
        for endpoint, counts in got.items():
            slowest[endpoint] = max(slowest.get(endpoint, 0), counts.pop("slowest_ms", 0))
            statuses.setdefault(endpoint, Counter()).update(counts)
    log_text = server.log_path.read_text(errors="replace")
    return {"backend": args.backend, "workers": args.workers, "shards": args.shards, "examples_per_shard_endpoint": per_shard,
            "exit_codes": codes, "wall_s": round(wall, 1), "server_alive_at_end": alive,
            "requests": {e: sum(c.values()) for e, c in statuses.items()},
            "statuses": {e: dict(c) for e, c in statuses.items()}, "slowest_ms": slowest,
            "server_tracebacks": log_text.count("Traceback"), "machine": machine_info()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["cupy", "llama-server"], required=True)
    ap.add_argument("--examples", type=int, default=5000, help="requests per endpoint, over all shards")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--only", choices=["chat", "completions"], help="one endpoint (default: both)")
    ap.add_argument("--workers", type=int, default=1, help=(
        "worker actors (on one GPU they share it): llama-server samples under a grammar on the host, one slot after "
        "another, so several llama-server workers are what spreads that over the cores"))
    ap.add_argument("--seed", type=int, default=1, help="shard i uses hypothesis seed SEED + i")
    ap.add_argument("--device", default="auto", help="the engine's device (auto, cuda, cpu)")
    ap.add_argument("--model", help="GGUF path (default: the bundled Gemma 3 270M)")
    ap.add_argument("--binary", help="llama-server binary (default: the one deploy/install.sh built)")
    ap.add_argument("--timeout", type=int, default=3600, help="pytest's per-test timeout in each shard, s")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, default=Path("/tmp/fuzz"))
    args = ap.parse_args(argv)
    if args.backend == "llama-server" and not args.binary:
        from workers.llama_server.binary import find_llama_server

        args.binary = str(find_llama_server(None))
    if args.device == "auto":
        from workers.cupy.device import cuda_available

        args.device = "cuda" if cuda_available() else "cpu"
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fuzz-{args.backend}.json").write_text(json.dumps(result, indent=1))
    print("| backend | shards | requests | by status | slowest ms | shard exit codes | wall s | server tracebacks |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for endpoint, n in sorted(result["requests"].items()):
        by = ", ".join(f"{k}: {v}" for k, v in sorted(result["statuses"][endpoint].items()))
        print(f"| {args.backend} {endpoint} | {args.shards} | {n} | {by} | {result['slowest_ms'][endpoint]} | "
              f"{result['exit_codes']} | {result['wall_s']} | {result['server_tracebacks']} |")
    ok = all(c == 0 for c in result["exit_codes"]) and result["server_alive_at_end"]
    print("PASS" if ok else "FAIL", f"{sum(result['requests'].values())} requests")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
