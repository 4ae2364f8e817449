"""Gateway overhead: Pulse's added time to first token and throughput against a plain aiohttp relay.

In one run, interleaved per the protocol, at each client count:
- direct: the bench upstream (bench/relay.py), streaming `tokens` SSE events per request, called directly;
- relay:  a plain aiohttp relay in front of that upstream;
- pulse:  `pulse serve --backend loadtest` (its load-test backend streams the same number of tokens).
Added TTFT = target TTFT - direct TTFT in the same repeat (p50 from p50s, p99 from p99s); Pulse's req/s and
path CPU per request are compared with the relay's in the same repeat. Each run also reads the serving
processes' resident memory. Goals: at up to 32 clients Pulse adds <= 2 ms p50 and <= 10 ms p99, keeps
>= 0.8x the relay's req/s and spends <= 1.2x its CPU per request; with hundreds of streams held open
(`--rate`: tokens/s per stream, so each stream lasts tokens/rate seconds, as an agent's does) p99 added
TTFT <= 25 ms, with no errors.

    python -m bench.gateway_overhead --repeats 5 --warmup 2
    python -m bench.gateway_overhead --clients 256 1000 --rate 8 --duration 6   # streams held open ~2 s
    python -m bench.gateway_overhead --no-pulse     # relay against direct only
    python -m bench.gateway_overhead --pulse-b-cmd "..."   # a second Pulse (another tree) as `pulse_b`, interleaved

Pulse sends the text of chunks that reach a stream together as one delta; the relay passes the upstream's events
one for one. Without `--rate` the load-test backend sends its tokens back to back, so they reach the gateway
together and Pulse's clients parse fewer events than the relay's (`events_per_req`): req/s is then not a like-for-like
comparison. With `--rate` tokens are paced as an engine's steps pace them, and the events match.

With `--pulse-b-cmd` a second `pulse serve` (e.g. an older commit's tree) is measured in the same repeats as the
first, so an A/B of two trees shares every slice of time on a busy box; the goals are judged on `pulse` only.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench import loops, protocol
from bench.loadgen import LoadSpec, run_load
from bench.machine import checked_machine_info
from bench.procs import Proc, Served, cpu_ticks, owned_processes, python_module, rss_mib

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_P50_MS, GOAL_P99_MS, GOAL_REQ_RATIO, GOAL_CPU_RATIO = 2.0, 10.0, 0.8, 1.2
MANY_CLIENTS, GOAL_MANY_P99_MS = 256, 25.0  # from this many clients on, streams are held open: a looser p99
TABLE_METRICS = ["ttft_p50_ms", "ttft_p99_ms", "added_ttft_p50_ms", "added_ttft_p99_ms", "over_relay_ttft_p50_ms",
                 "req_s", "req_s_vs_relay", "events_per_req", "gateway_cpu_ms_per_req", "path_cpu_ms_per_req",
                 "cpu_vs_relay", "rss_mib",
                 "errors", "gateway_cpu_ms_per_req_vs_b", "path_cpu_ms_per_req_vs_b", "req_s_vs_b"]
GATEWAY_PROCESS = "ray::ServeRepli"  # the gateway replicas' name in /proc/PID/comm (15 characters)
PLOT_METRICS = ["added_ttft_p50_ms", "added_ttft_p99_ms", "req_s"]


def config_name(target: str, clients: int) -> str:
    return f"{target}@{clients}"


def derive(records: Sequence[dict], targets: Sequence[str], clients: Sequence[int]) -> list[dict]:
    """Per repeat and client count: each target's TTFT over direct's and over the relay's, req/s over relay's.

    Pairing within a repeat keeps the comparison inside one slice of time, which is what interleaving buys.
    """
    out = []
    for repeat, cfgs in protocol.by_repeat(records).items():
        for c in clients:
            direct, relay = cfgs.get(config_name("direct", c)), cfgs.get(config_name("relay", c))
            for target in targets:
                m = cfgs.get(config_name(target, c))
                if target == "direct" or m is None or direct is None:
                    continue
                d = {f"added_ttft_{p}_ms": _sub(m, direct, f"ttft_{p}_ms") for p in ("p50", "p99")}
                if relay is not None and target != "relay":
                    d["over_relay_ttft_p50_ms"] = _sub(m, relay, "ttft_p50_ms")
                    d["req_s_vs_relay"] = m["req_s"] / relay["req_s"] if relay["req_s"] else None
                    if (cpu := _ratio(m, relay, "path_cpu_ms_per_req")) is not None:
                        d["cpu_vs_relay"] = cpu
                if target == "pulse" and (b := cfgs.get(config_name("pulse_b", c))) is not None:
                    for key in ("gateway_cpu_ms_per_req", "path_cpu_ms_per_req", "req_s"):  # A over B, same repeat
                        if (r := _ratio(m, b, key)) is not None:
                            d[f"{key}_vs_b"] = r
                out.append({"phase": "measure", "repeat": repeat, "config": config_name(target, c), "metrics": d})
    return out


def _sub(a: dict, b: dict, key: str) -> float | None:
    return None if a.get(key) is None or b.get(key) is None else a[key] - b[key]


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return None if a.get(key) is None or not b.get(key) else a[key] / b[key]


def goals(clients: int) -> tuple[tuple[str, float, str], ...]:
    """(metric, goal, "<=" or ">=") for Pulse at this many clients."""
    if clients >= MANY_CLIENTS:
        return ("added_ttft_p99_ms", GOAL_MANY_P99_MS, "<="), ("errors", 0.0, "<=")
    return (("added_ttft_p50_ms", GOAL_P50_MS, "<="), ("added_ttft_p99_ms", GOAL_P99_MS, "<="),
            ("req_s_vs_relay", GOAL_REQ_RATIO, ">="), ("cpu_vs_relay", GOAL_CPU_RATIO, "<="))


def verdict(summary: dict, clients: Sequence[int]) -> list[str]:
    """One line per goal, judged on medians over repeats."""
    lines = []
    for c in clients:
        s = summary.get(config_name("pulse", c))
        if not s:
            continue
        for key, goal, better in goals(c):
            if key not in s:
                continue
            med = s[key]["median"]
            ok = med <= goal if better == "<=" else med >= goal
            lines.append(f"{'MET ' if ok else 'MISS'} {c} clients: {key} median {med:.2f} (goal {better} {goal:g})")
    return lines


def start_targets(args, log_dir: Path, procs: list[Proc]) -> dict[str, tuple[str, str]]:
    """Start upstream, relay and (unless --no-pulse) Pulse; returns {target: (base url, model id)}."""
    # one after another, each healthy before the next starts: the relay needs the upstream's port, and a
    # server whose port was taken meanwhile is started again on another (Served)
    up = Served(procs, "upstream", lambda port: python_module(
        "bench.relay", "upstream", "--port", str(port), "--tokens", str(args.tokens), "--rate", str(args.rate),
        "--ttft", str(args.ttft), "--loop", args.loop), log_dir)
    targets = {"direct": up.ready(args.start_timeout)}
    relay = Served(procs, "relay", lambda port: python_module(
        "bench.relay", "relay", "--port", str(port), "--upstream", targets["direct"], "--loop", args.loop), log_dir)
    targets["relay"] = relay.ready(args.start_timeout)
    if not args.no_pulse:
        config = pulse_config(log_dir, args.tokens, args.rate, args.ttft)
        pulses = {"pulse": args.pulse_cmd, **({"pulse_b": args.pulse_b_cmd} if args.pulse_b_cmd else {})}
        started = [Served(procs, name, lambda port, cmd=cmd: shlex.split(cmd.format(port=port, config=config)),
                          log_dir) for name, cmd in pulses.items()]  # started together: each takes seconds
        for served in started:
            targets[served.name] = served.ready(args.start_timeout)
    return {name: (url, first_model(url)) for name, url in targets.items()}


def pulse_config(log_dir: Path, tokens: int, rate: float, ttft: float = 0.0) -> Path:
    """A config file giving Pulse's load-test backend the upstream's stream: `tokens` at `rate` tokens/s, the
    first after `ttft` seconds."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "pulse.yaml"
    path.write_text(f"workers:\n  loadtest: {{tokens: {tokens}, tokens_per_s: {rate}, ttft_s: {ttft}}}\n")
    return path


def serving_paths(procs: list[Proc]) -> dict[str, list[Proc]]:
    """The processes each target's requests go through (started in the order upstream, relay, pulse, pulse_b)."""
    up, relay, *rest = procs
    return {"direct": [up], "relay": [relay, up], **{p.name: [p] for p in rest}}


def first_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def measures(args, targets: dict[str, tuple[str, str]], paths: dict[str, list[Proc]]) -> dict[str, protocol.Measure]:
    out = {}
    for c in args.clients:
        for target, (url, model) in targets.items():
            spec = LoadSpec(url=url, model=model, clients=c, duration=args.duration, requests=args.max_requests,
                            max_tokens=args.tokens, api=args.api)
            out[config_name(target, c)] = lambda spec=spec, path=paths[target]: _load_with_cpu(spec, path)
    return out


async def _load_with_cpu(spec: LoadSpec, path: list[Proc]) -> dict:
    """One load run, plus the CPU time the serving processes spent per served request and their resident
    memory at the end of the run.

    On a 2-core box req/s is set by CPU cost per request; this says where a slower path spends it.
    """
    pids = [pid for proc in path for pid in proc.tree()]
    before = cpu_ticks(pids)
    out = await run_load(spec)
    after = cpu_ticks(pids)
    rss = rss_mib(pids)
    out["metrics"]["rss_mib"] = sum(rss.values())
    out["rss_mib_by_process"] = {k: round(v, 1) for k, v in sorted(rss.items(), key=lambda kv: -kv[1])}
    ok = out["metrics"]["ok"]
    scale = 1000.0 / os.sysconf("SC_CLK_TCK") / ok if ok else 0.0
    by_name: dict[str, float] = {}
    for pid, (name, ticks) in after.items():
        if pid in before:
            by_name[name] = by_name.get(name, 0.0) + (ticks - before[pid][1]) * scale
    out["metrics"]["path_cpu_ms_per_req"] = sum(by_name.values()) if ok else None
    if GATEWAY_PROCESS in by_name:  # Pulse's gateway replicas alone (HTTP in, the chat core, the worker leg)
        out["metrics"]["gateway_cpu_ms_per_req"] = by_name[GATEWAY_PROCESS]
    out["cpu_ms_per_req_by_process"] = {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}
    return out


def summarize(records: list[dict], targets: Sequence[str], clients: Sequence[int]) -> dict:
    """Per configuration, its measured and derived (added-over-direct) metrics; rows by client count, then
    by target in `targets` order, whatever order the last repeat ran in."""
    measured = protocol.summarize(records)
    for cfg, ms in protocol.summarize(derive(records, list(targets), clients)).items():
        measured.setdefault(cfg, {}).update(ms)
    order = [config_name(t, c) for c in clients for t in targets]
    return {cfg: measured[cfg] for cfg in order if cfg in measured}


def report(args, records, targets, machine, started) -> dict:
    summary = summarize(records, list(targets), args.clients)
    params = vars(args) | {"targets": targets, "loop": loops.resolve(args.loop)}
    return protocol.publish("gateway_overhead", records, summary, params, started, machine,
                            verdict(summary, args.clients), TABLE_METRICS, PLOT_METRICS, args.out)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--duration", type=float, default=3.0, help="seconds of load per run")
    ap.add_argument("--max-requests", type=int, default=None, help="cap on requests per run")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per response (the upstream's and Pulse's)")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="tokens/s per stream, upstream and Pulse alike (0: as fast as possible); a rate holds each "
                         "stream open tokens/rate seconds, as agents' streams are")
    ap.add_argument("--ttft", type=float, default=0.0,
                    help="seconds before each stream's first token, upstream and Pulse alike (an engine's prefill: "
                         "the hops' cost after a wait, as in front of llama-server)")
    ap.add_argument("--api", choices=["chat", "completions"], default="chat")
    ap.add_argument("--no-pulse", action="store_true", help="measure the relay against direct only")
    ap.add_argument("--pulse-cmd", default="pulse serve --backend loadtest --model gemma-3-270m --host 127.0.0.1 "
                                           "--port {port} --config {config}")
    ap.add_argument("--pulse-b-cmd", default=None,
                    help="a second Pulse target, `pulse_b`, measured in the same repeats (same {port} and {config})")
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--loop", choices=loops.CHOICES, default="auto",
                    help="event loop of the relay, upstream and load generator (auto: uvloop if installed, as Ray)")
    protocol.add_arguments(ap, RESULTS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    machine, started = checked_machine_info(), time.time()
    log_dir = args.out / f"logs-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}"
    with owned_processes() as procs:
        targets = start_targets(args, log_dir, procs)
        runs = measures(args, targets, serving_paths(procs))
        records = loops.run(protocol.run(runs, args.repeats, args.warmup, not args.quiet), args.loop)
        report(args, records, {k: v[0] for k, v in targets.items()}, machine, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
