"""Where llama-server's HTTP throughput goes (issue 5): aggregate generated tok/s over streaming /completion
against llama.cpp's own llama-batched-bench, same model, same GPU, same run.

On the H200, llama-server over HTTP with streaming measured ~0.5-1k tok/s aggregate from 8 to 64 clients while
llama-batched-bench reached ~11k tok/s. The suspects, each isolated by one configuration:
- slot count: `np{n}@{n}` (n slots, n clients) for each --slots value, and `np{min}@{max}` (clients queue);
- host-side sampling over the 262k vocabulary: at the largest slot count, Pulse's sampling settings
  (temperature 1, top_k 0: the full vocabulary goes through the sampler chain every token) against `/greedy`
  (temperature 0, top_k 1), `/stock` (llama-server's defaults: top_k 40 ...), and `-bs` servers that sample on
  the GPU (`--backend-sampling`);
- HTTP streaming: `/nostream` (one JSON answer per request instead of one SSE event per token).
Every server runs Pulse's worker flags (workers/llama_server/flags.py: --kv-unified --no-cache-idle-slots
--slots ..., plus the cuda profile's `-fa on --metrics --cache-ram -1 -ub 512`), -ngl 99, and -c sized to the slots.
All servers start first and stay up; every repeat runs every configuration and llama-batched-bench (-npl at the
same slot counts) once, in rotated order, after discarded warm-ups. Tokens come from `timings.predicted_n`
(ignore_eos, so each request generates exactly --tokens); llama-server's /metrics counters (llama_decode
calls, tokens) are read around every run, giving tokens per decode call (the batch it reached) and wall ms per
decode call, to set against batched-bench's ms per step at the same batch.

    python3 -m bench.llama_server_gap --server /root/lb/build/bin/llama-server --model $MODEL --out $OUT
    python -m bench.llama_server_gap --server ~/.cache/pulse/llama.cpp/11434.0.0/bin/llama-server \\
        --slots 1 2 --tokens 4 --prompt-tokens 16 --threads 1 --repeats 5 --warmup 1    # CPU smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import protocol
from bench.loadgen import LoadSpec, run_load
from bench.machine import machine_info
from bench.procs import Proc, free_port, stop_all

RESULTS = Path(__file__).resolve().parent / "results"
# policy/profiles/cuda.yaml's llama_server_args but --backend-sampling, which this bench measures as a server of its
# own (np<top>-bs) against these (a unit test keeps them equal; the GPU box may lack PyYAML)
CUDA_PROFILE_ARGS = ["-fa", "on", "--metrics", "--cache-ram", "-1", "-ub", "512"]
SAMPLING = {
    "pulse": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},  # what Pulse sends by default
    "greedy": {"temperature": 0.0, "top_k": 1},
    "stock": {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05},  # llama-server's defaults
}
TABLE_METRICS = ["gen_tok_s", "vs_batched_bench", "tokens_per_decode", "ms_per_decode", "bb_ms_per_step",
                 "ttft_p50_ms", "ttft_p99_ms", "total_p50_ms", "tokens_per_req", "errors"]
_METRIC_LINE = re.compile(r"^llamacpp:(\w+)\s+([-+0-9.eE]+|nan|inf)\s*$", re.M)


@dataclass(frozen=True)
class Server:
    name: str
    slots: int
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    name: str
    server: str
    clients: int
    sampling: str = "pulse"
    stream: bool = True


@dataclass
class Plan:
    servers: dict[str, Server] = field(default_factory=dict)
    configs: list[Config] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # servers that did not start


def plan(slots: Sequence[int], backend_sampling: bool = True, extra_args: Sequence[str] = ()) -> Plan:
    """The servers to start and the configurations to measure (see the module docstring)."""
    if not slots:
        raise ValueError("no slot counts")
    p = Plan()
    top, low = max(slots), min(slots)
    for n in sorted(set(slots)):
        p.servers[f"np{n}"] = Server(f"np{n}", n)
        p.configs.append(Config(f"np{n}@{n}", f"np{n}", n))
    if low < top:
        p.configs.append(Config(f"np{low}@{top}", f"np{low}", top))
    big = f"np{top}"
    p.configs += [Config(f"{big}@{top}/greedy", big, top, "greedy"), Config(f"{big}@{top}/stock", big, top, "stock"),
                  Config(f"{big}@{top}/nostream", big, top, stream=False)]
    if backend_sampling:
        p.servers[f"{big}-bs"] = Server(f"{big}-bs", top, ("--backend-sampling",))
        p.configs += [Config(f"{big}-bs@{top}", f"{big}-bs", top), Config(f"{big}-bs@{top}/greedy", f"{big}-bs", top,
                                                                          "greedy")]
    if extra_args:
        p.servers[f"{big}-x"] = Server(f"{big}-x", top, tuple(extra_args))
        p.configs.append(Config(f"{big}-x@{top}", f"{big}-x", top))
    return p


def kv_tokens(slots: int, prompt: int, tokens: int) -> int:
    """-c for a unified pool that holds every slot's prompt and generation, with headroom, in 256s."""
    need = slots * (prompt + tokens + 16)
    return -(-need // 256) * 256


def server_argv(binary: Path, server: Server, args, port: int) -> list[str]:
    """Pulse's worker command line (workers/llama_server/flags.py) for this server."""
    from workers.llama_server import flags

    supported = flags.supported_flags(binary)
    profile = [*CUDA_PROFILE_ARGS, "-ngl", str(args.ngl), *server.args]
    return flags.server_argv(binary, supported, model=str(args.model), port=port, slots=server.slots,
                             kv_tokens=kv_tokens(server.slots, args.prompt_tokens, args.tokens),
                             profile_args=profile, threads=args.threads)


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    """A fixed prompt of n token ids (BOS, then a spread of ordinary ids): no tokenizer needed on the GPU box.
    Another `salt`, another prompt."""
    return [2, *((1000 + 7919 * (i + 131 * salt)) % 100_000 + 1000 for i in range(n - 1))]


def parse_metrics(text: str) -> dict[str, float]:
    """llama-server's Prometheus text: {name without the llamacpp: prefix: value}."""
    return {m.group(1): float(m.group(2)) for m in _METRIC_LINE.finditer(text)}


def decode_figures(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float | None]:
    """Counters over one run: llama_decode calls, tokens per call (the batch reached) and wall ms per call."""
    calls = after.get("n_decode_total", 0.0) - before.get("n_decode_total", 0.0)
    tokens = after.get("tokens_predicted_total", 0.0) - before.get("tokens_predicted_total", 0.0)
    return {"decode_calls": calls, "tokens_per_decode": tokens / calls if calls else None,
            "ms_per_decode": wall_s * 1000 / calls if calls else None}


def batched_bench_rows(jsonl: str) -> dict[str, float]:
    """llama-batched-bench --output-format jsonl -> {speed_tg@pl, ms_per_step@pl, speed@pl}."""
    out = {}
    for line in jsonl.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        pl = int(row["pl"])
        out[f"bb_speed_tg@{pl}"] = row["speed_tg"]
        out[f"bb_ms_per_step@{pl}"] = row["t_tg"] * 1000 / row["tg"]
        out[f"bb_speed@{pl}"] = row["speed"]
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        return parse_metrics(await r.text()) if r.status == 200 else {}


async def measure_config(cfg: Config, url: str, args, ids: list[int]) -> dict:
    spec = LoadSpec(url=url, api="llama", prompt=ids, max_tokens=args.tokens, stream=cfg.stream,
                    clients=cfg.clients, requests=cfg.clients * args.requests_per_client, duration=args.timeout,
                    timeout=args.timeout, body_extra={**SAMPLING[cfg.sampling], "ignore_eos": True})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        before = await scrape(session, url)
        out = await run_load(spec)
        after = await scrape(session, url)
    m = out["metrics"]
    flat = {"gen_tok_s": m["tok_s"], "ttft_p50_ms": m["ttft_p50_ms"], "ttft_p99_ms": m["ttft_p99_ms"],
            "total_p50_ms": m["total_p50_ms"], "errors": m["errors"], "wall_s": m["wall_s"],
            "tokens_per_req": m["tok_s"] * m["wall_s"] / m["ok"] if m["ok"] else None,
            **decode_figures(before, after, m["wall_s"])}
    return {"metrics": flat, "status_counts": out["status_counts"], "error_kinds": out["error_kinds"]}


async def measure_batched_bench(binary: Path, args, npl: Sequence[int]) -> dict:
    argv = [str(binary), "-m", str(args.model), "-ngl", str(args.ngl), "-fa", "on", "-b", "2048", "-ub", "512",
            "-c", str(kv_tokens(max(npl), args.prompt_tokens, args.tokens)), "-npp", str(args.prompt_tokens),
            "-ntg", str(args.tokens), "-npl", ",".join(map(str, npl)), "--output-format", "jsonl"]
    if args.threads:
        argv += ["-t", str(args.threads)]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    stdout, stderr = await proc.communicate()
    rows = batched_bench_rows(stdout.decode(errors="replace"))
    if proc.returncode or not rows:
        raise RuntimeError(f"llama-batched-bench failed ({proc.returncode}): {stderr.decode(errors='replace')[-1500:]}")
    return {"metrics": rows, "argv": argv}


def derive(records: list[dict], configs: Sequence[Config]) -> list[dict]:
    """Per repeat: each configuration's tok/s over batched-bench's decode tok/s at its client count (same repeat),
    and batched-bench's ms per step at that batch beside the server's ms per decode call."""
    by_name = {c.name: c for c in configs}
    out = []
    for repeat, cfgs in protocol.by_repeat(records).items():
        bb = cfgs.get("batched-bench")
        if not bb:
            continue
        for name, m in cfgs.items():
            cfg = by_name.get(name)
            ref = bb.get(f"bb_speed_tg@{cfg.clients}") if cfg else None
            if not ref or m.get("gen_tok_s") is None:
                continue
            out.append({"phase": "measure", "repeat": repeat, "config": name,
                        "metrics": {"vs_batched_bench": m["gen_tok_s"] / ref,
                                    "bb_ms_per_step": bb[f"bb_ms_per_step@{cfg.clients}"]}})
    return out


def summarize(records: list[dict], configs: Sequence[Config]) -> dict:
    measured = protocol.summarize(records)
    for name, ms in protocol.summarize(derive(records, configs)).items():
        measured.setdefault(name, {}).update(ms)
    order = [c.name for c in configs] + ["batched-bench"]
    return {name: measured[name] for name in order if measured.get(name)}  # skipped runs leave none


def batched_bench_table(summary: dict) -> str:
    bb = summary.get("batched-bench", {})
    pls = sorted({int(k.split("@")[1]) for k in bb})
    rows = [f"| {pl} | {protocol._cell(bb.get(f'bb_speed_tg@{pl}'), 1)} | "
            f"{protocol._cell(bb.get(f'bb_ms_per_step@{pl}'), 2)} | {protocol._cell(bb.get(f'bb_speed@{pl}'), 1)} |"
            for pl in pls]
    return "\n".join(["| batch (-npl) | decode tok/s (S_TG) | ms per step | prompt+decode tok/s (S) |",
                      "| --- | --- | --- | --- |", *rows])


async def run_all(args, p: Plan, urls: dict[str, str], bb: Path | None) -> list[dict]:
    ids = prompt_ids(args.prompt_tokens)
    measures: dict[str, protocol.Measure] = {
        c.name: (lambda c=c: measure_config(c, urls[c.server], args, ids)) for c in p.configs}
    if bb is not None:
        npl = sorted({c.clients for c in p.configs})
        measures["batched-bench"] = lambda: measure_batched_bench(bb, args, npl)
    deadline = time.monotonic() + args.budget_s

    def within_budget(measure: protocol.Measure) -> protocol.Measure:
        # past the budget the remaining runs are skipped (empty metrics, left out of the summary), so a slow
        # machine still returns what it measured before the device call's time limit
        async def run() -> dict:
            return await measure() if time.monotonic() < deadline else {"metrics": {}, "skipped": True}
        return run

    records = await protocol.run({k: within_budget(m) for k, m in measures.items()}, args.repeats, args.warmup,
                                 progress=not args.quiet)
    skipped = sum(1 for r in records if r.get("detail", {}).get("skipped"))
    if skipped:
        print(f"warning: budget of {args.budget_s:.0f} s spent: {skipped} of {len(records)} runs skipped",
              file=sys.stderr)
    return records


def start_servers(args, p: Plan, log_dir: Path, procs: list[Proc]) -> dict[str, str]:
    """Start every server at once (they load in parallel), then wait for each; returns {name: url}.

    A server that does not come up (e.g. a flag this build rejects) is dropped with its configurations and
    named in the output, so the rest of the run still happens within the machine's time.
    """
    urls = {}
    for s in p.servers.values():
        port = free_port()
        procs.append(Proc(f"llama-server-{s.name}", server_argv(args.server, s, args, port), log_dir))
        urls[s.name] = f"http://127.0.0.1:{port}"
    for proc, (name, url) in zip(list(procs), list(urls.items())):
        try:
            proc.wait_healthy(url + "/health", timeout=args.start_timeout)
        except RuntimeError as e:
            print(f"warning: server {name} did not start; its configurations are skipped:\n{e}", file=sys.stderr)
            p.dropped.append(name)
            del urls[name]
    p.configs = [c for c in p.configs if c.server in urls]
    if not urls:
        raise RuntimeError("no llama-server started")
    return urls


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_server_gap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", type=Path, required=True, help="llama-server binary (the CUDA build on the GPU)")
    ap.add_argument("--batched-bench", type=Path, default=None,
                    help="llama-batched-bench (default: next to --server; skipped if absent)")
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled model)")
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 32, 64], help="-np values; clients = slots")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request (ignore_eos)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--threads", type=int, default=None, help="-t for llama-server and batched-bench (CPU runs)")
    ap.add_argument("--no-backend-sampling", action="store_true", help="skip the --backend-sampling servers")
    ap.add_argument("--extra-server-args", default="", help="one more server at the top slot count with these "
                    "args (e.g. '-b 256'), measured with Pulse's sampling")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request and per run")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--budget-s", type=float, default=300.0, help="measuring stops after this (runs left skipped)")
    ap.add_argument("--repeats", type=int, default=protocol.MIN_REPEATS)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or RESULTS))
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.model is None:
        from workers.protocol.model import bundled_model_path

        args.model = bundled_model_path()
    bb = args.batched_bench or args.server.parent / "llama-batched-bench"
    bb = bb if bb.exists() else None
    from workers.llama_server import flags

    bs = not args.no_backend_sampling and "--backend-sampling" in flags.supported_flags(args.server)
    p = plan(args.slots, bs, args.extra_server_args.split())
    machine, started = machine_info(), time.time()
    log_dir = args.out / f"llama_server_gap-logs-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}"
    procs: list[Proc] = []
    try:
        urls = start_servers(args, p, log_dir, procs)
        print(f"servers up in {time.time() - started:.1f} s; batched-bench: {bb or 'not found, skipped'}",
              file=sys.stderr)
        records = asyncio.run(run_all(args, p, urls, bb))
    finally:
        stop_all(procs)
    summary = summarize(records, p.configs)
    params = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "servers": {s.name: server_argv(args.server, s, args, 0) for s in p.servers.values()},
        "configs": [vars(c) for c in p.configs], "servers_dropped": p.dropped,
        "batched_bench": str(bb) if bb else None}
    doc = protocol.result_document("llama_server_gap", records, summary, params, started, machine)
    table = protocol.markdown_table({k: v for k, v in summary.items() if k != "batched-bench"}, TABLE_METRICS)
    text = f"`{doc['command']}`\n\n{table}\n\nllama-batched-bench, same run:\n\n{batched_bench_table(summary)}\n"
    if p.dropped:
        text += f"\nservers that did not start (configurations skipped): {', '.join(p.dropped)}\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(doc["finished"]))
    (args.out / f"llama_server_gap-{stamp}.json").write_text(json.dumps(doc, indent=1, default=str))
    (args.out / f"llama_server_gap-{stamp}.md").write_text(text)
    print(f"\n{text}\nwall {time.time() - started:.0f} s; JSON: {args.out}/llama_server_gap-{stamp}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
