"""Pulse + llama-server against the same llama-server called directly: aggregate tok/s, TTFT and errors.

One `pulse serve --backend llama-server` (one worker; the device profile's slots and flags unless --slots)
is started, and the llama-server process its worker runs is found among its descendants
(bench.llama_server_overhead). For every API, sampling mode and client count, interleaved per bench.protocol
(warm-up discarded, order rotated), the same streaming OpenAI request goes to:
- direct: that very llama-server's own /v1/completions or /v1/chat/completions (same binary, flags,
  model, slots and KV state: only the path differs), as a user calling llama-server would send it;
- pulse: Pulse's /v1/completions or /v1/chat/completions.
Completions send the prompt as token ids (BOS included), chat as one user message. Modes: `greedy`
(temperature 0) and `t1` (temperature 1, nothing else: OpenAI's defaults). llama-server fills unset fields
with its own defaults (top_k 40, top_p 0.95, min_p 0.05), a narrower distribution than OpenAI's, which
Pulse keeps; `t1exact` sends direct top_k 0, top_p 1, min_p 0 too, so both sample the same distribution.
`--think-ms 0 50` adds cells whose clients wait between requests (bench.loadgen's think_s), each arrival at a
random phase of llama-server's steps. Per repeat, pulse is set against direct: tok_s_ratio (pulse / direct) and
added TTFT p50/p99 (pulse - direct). Goal: ratio >= 0.95 and added p50 <= 2 ms, no 5xx.
`--variants` runs one `pulse serve` (and so one llama-server) per set of extra llama-server flags, all at once,
their cells interleaved in one run: variant i's targets are `direct.vI` and `pulse.vI` (variant 0's keep the plain
names), and each variant's direct is also set against variant 0's in the same repeat (tok_s_vs_v0), e.g.
`--variants '' '--cache-ram 0'` for what llama-server's RAM prompt cache costs under this load; a variant that starts
with `=` replaces the device profile's llama-server flags instead (`--variants '' '=-fa on --metrics --cache-ram 0 -ub
512'`: the h200 profile without `--backend-sampling`, which has no negation). `--variant-binaries` gives a variant
its own llama-server (e.g. llama.cpp without deploy/llama_patches/ against the patched build, same flags), and
`--variant-worker-queues` its Pulse's `admission.worker_queue_max` (`--variants '' '' --variant-worker-queues '' 4`:
requests sent beyond llama-server's slots, waiting in its own queue, against none), and `--variant-holds` its worker's
`workers.llama_server.hold_ms` (`--variants '' '' --variant-holds '' 0`: the hold against none), and
`--variant-configs` any Pulse settings as JSON merged over the rest (`--variants '' '' --variant-configs ''
'{"admission": {"gateway_order_s": null}}'`: the order across gateway replicas against none).
`--trace` has every `pulse serve` export its spans to an OTLP receiver in the bench and splits each Pulse run's
TTFT into the gateway's queue, the hop to the worker, the worker's hold, llama-server's own wait and its prefill
(bench.request_timeline: `trace_*` metrics, and the slowest tenth's parts in the verdict lines). Recording spans
costs the gateway and the worker CPU: a traced run says where time goes, not how fast Pulse is.

    python -m bench.llama_server_parity --clients 1 8 32 64 --modes greedy t1 --apis completions chat
    python -m bench.llama_server_parity --clients 1 8 32 64 --tokens 8 --repeats 2 --warmup 1   # CPU box
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path

from bench import llama_server_log as server_log
from bench import loops, protocol
from bench import request_timeline as timeline
from bench.gateway_overhead import _load_with_cpu, first_model
from bench.llama_server_overhead import PROMPT, Pid, prompt_ids, start_pulse
from bench.loadgen import LoadSpec
from bench.machine import checked_machine_info
from bench.procs import Proc, owned_processes
from pulse.config import merge
from tests.otlp_sink import OtlpSink

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_RATIO, GOAL_ADDED_P50_MS = 0.95, 2.0
TARGETS = ("direct", "pulse")
MODES = {
    "greedy": ({"temperature": 0.0}, {}),
    "t1": ({"temperature": 1.0}, {}),
    "t1exact": ({"temperature": 1.0}, {"top_k": 0, "top_p": 1.0, "min_p": 0.0}),  # extra fields: direct only
}
TABLE_METRICS = ["tok_s", "tok_s_ratio", "tok_s_vs_v0", "ttft_p50_ms", "ttft_p99_ms", "added_ttft_p50_ms",
                 "added_ttft_p99_ms", "launches_per_group", "deferred_picks", "server_prompt_p50_ms",
                 "server_reserve_ms", "errors", "rate_limited"]
PLOT_METRICS = ["tok_s", "tok_s_ratio", "added_ttft_p50_ms"]
TRACE_METRICS = ["trace_ttft_p99_ms", "trace_gateway_queue_p99_ms", "trace_held_p99_ms", "trace_server_wait_p99_ms",
                 "trace_tail_gateway_queue_mean_ms", "trace_tail_server_wait_mean_ms", "trace_tail_beyond_frac"]


def cell(target: str, api: str, mode: str, clients: int, think_ms: float = 0) -> str:
    """`pulse/completions/greedy@32`, with `+think50` where clients think 50 ms on average between requests."""
    return f"{target}/{api}/{mode}@{clients}" + (f"+think{think_ms:g}" if think_ms else "")


def target(kind: str, variant: int) -> str:
    """`direct` / `pulse` for variant 0, `direct.v1` / `pulse.v1` for variant 1, ..."""
    return kind if variant == 0 else f"{kind}.v{variant}"


def direct_of(name: str) -> str | None:
    """The direct cell a pulse cell is paired with (same variant, API, mode and clients); None for a direct cell."""
    tgt, rest = name.split("/", 1)
    return "direct" + tgt[len("pulse"):] + "/" + rest if tgt.startswith("pulse") else None


def config_yaml(args, log_dir: Path, variant: str = "", binary: str | None = None, worker_queue: int | None = None,
                hold_ms: float | None = None, more: dict | None = None) -> str:
    """`more`: Pulse settings merged over the rest (a variant's --variant-configs)."""
    ls = {"log_dir": str(log_dir)}
    if hold_ms is not None:
        ls["hold_ms"] = hold_ms
    for key in ("slots", "kv_tokens", "threads", "binary"):
        if getattr(args, key):
            ls[key] = getattr(args, key)
    if binary:
        ls["binary"] = binary
    if args.slot_affinity == "off":
        ls["slot_affinity"] = False
    # a variant "=FLAGS" replaces the device profile's llama-server flags with FLAGS (workers.llama_server.profile_args:
    # some flags, --backend-sampling among them, have no negation to add); any other variant's flags are added
    replace = variant.startswith("=")
    if replace:
        ls["profile_args"] = variant[1:].split()
    # timestamps let bench.llama_server_log time each launch (the RAM prompt cache's saves) from the server's log
    ls["extra_args"] = ["--log-timestamps", *args.server_args.split(), *([] if replace else variant.split())]
    doc = {"model": {"path": args.model, "name": args.model},  # one model (naming none serves both bundled ones)
           "workers": {"backend": "llama-server", "count": 1, "llama_server": ls}}
    if args.gateway_replicas:
        doc["server"] = {"gateway_replicas": args.gateway_replicas}  # host and port: start_pulse's flags
    if args.queue_deadline:  # Pulse refuses (429) what its queue cannot serve within this; llama-server just queues
        doc["admission"] = {"queue_deadline_s": args.queue_deadline}
    if worker_queue is not None:
        doc.setdefault("admission", {})["worker_queue_max"] = worker_queue
    return json.dumps(merge(doc, more or {}))  # JSON is YAML


def specs(args, ids: list[int], pulse_url: str, model: str, direct_url: str, variant: int = 0
          ) -> dict[str, LoadSpec]:
    out = {}
    for api in args.apis:
        prompt = ids if api == "completions" else PROMPT
        for mode in args.modes:
            both, direct_only = MODES[mode]
            for c, think in ((c, t) for c in args.clients for t in args.think_ms):
                common = dict(api=api, prompt=prompt, clients=c, duration=args.duration, max_tokens=args.tokens,
                              requests=max(args.min_requests, c * args.requests_per_client), timeout=args.timeout,
                              think_s=think / 1000.0)
                # a new connection per request to llama-server, as Pulse's backend does: cpp-httplib closes
                # kept-alive connections under load
                out[cell(target("direct", variant), api, mode, c, think)] = LoadSpec(
                    url=direct_url, model=model, force_close=True, body_extra=both | direct_only, **common)
                out[cell(target("pulse", variant), api, mode, c, think)] = LoadSpec(
                    url=pulse_url, model=model, body_extra={**both}, **common)
    return out


def derive(records: list[dict]) -> list[dict]:
    """Per repeat and cell: pulse's tok/s over direct's and its TTFT minus direct's, within the same repeat; a
    later variant's direct: its tok/s over variant 0's direct (tok_s_vs_v0)."""
    out = []
    for repeat, cfgs in protocol.by_repeat(records).items():
        for name, m in cfgs.items():
            if name.startswith("direct.v"):
                d0 = cfgs.get("direct/" + name.split("/", 1)[1])
                if d0 and d0.get("tok_s") and m.get("tok_s") is not None:
                    out.append({"phase": "measure", "repeat": repeat, "config": name,
                                "metrics": {"tok_s_vs_v0": m["tok_s"] / d0["tok_s"]}})
            if (paired := direct_of(name)) is None or (d := cfgs.get(paired)) is None:
                continue
            derived = {f"added_ttft_{p}_ms": (m[f"ttft_{p}_ms"] - d[f"ttft_{p}_ms"])
                       if m.get(f"ttft_{p}_ms") is not None and d.get(f"ttft_{p}_ms") is not None else None
                       for p in ("p50", "p99")}
            derived["tok_s_ratio"] = m["tok_s"] / d["tok_s"] if d.get("tok_s") else None
            out.append({"phase": "measure", "repeat": repeat, "config": name, "metrics": derived})
    return out


def summarize(records: list[dict], order: Sequence[str]) -> dict:
    measured = protocol.summarize(records)
    for cfg, ms in protocol.summarize(derive(records)).items():
        measured.setdefault(cfg, {}).update(ms)
    return {cfg: measured[cfg] for cfg in order if cfg in measured}


def verdict(summary: dict) -> list[str]:
    """One line per pulse cell: median tok/s ratio and added TTFT p50 against the goals, and any failures; one per
    later variant's direct cell: its tok/s against variant 0's direct."""
    lines = []
    for name, ms in summary.items():
        if (vs := ms.get("tok_s_vs_v0")) is not None:
            lines.append(f"VS0  {name}: tok/s x{vs['median']:.2f} ({vs['min']:.2f}-{vs['max']:.2f}) "
                         "of variant 0's direct")
        if (paired := direct_of(name)) is None:
            continue
        ratio, added = ms.get("tok_s_ratio"), ms.get("added_ttft_p50_ms")
        direct = summary.get(paired, {})
        failed = sum(s["max"] for k in ("errors",) for s in (ms.get(k), direct.get(k)) if s)
        if ratio is None or added is None:
            lines.append(f"NONE {name}: a target served nothing")
            continue
        ok = ratio["median"] >= GOAL_RATIO and added["median"] <= GOAL_ADDED_P50_MS and not failed
        lines.append(f"{'MET ' if ok else 'MISS'} {name}: tok/s x{ratio['median']:.2f} "
                     f"({ratio['min']:.2f}-{ratio['max']:.2f}), added TTFT p50 {added['median']:+.1f} ms "
                     f"({added['min']:+.1f}..{added['max']:+.1f}), errors (worst repeat, both) {failed:g}")
    return lines


async def _measure(spec: LoadSpec, path: list, pulse: Proc, log_dir: Path | None = None, sink=None,
                   traced: list | None = None) -> dict:
    """One run; with `log_dir`, also what llama-server's own log says of the run's launches
    (bench.llama_server_log.slice_metrics: how many launch groups its requests came in, its prompt eval p50); with
    `sink` (an OTLP receiver `pulse serve` exports to), where the run's TTFT went (bench.request_timeline), its rows
    appended to `traced`."""
    if pulse.popen.poll() is not None:  # measuring a dead server would only record connection errors
        raise RuntimeError(f"pulse serve exited with {pulse.popen.returncode}:\n{pulse.log_tail()}")
    log = max(log_dir.glob("llama-server-*.log"), key=lambda p: p.stat().st_mtime, default=None) if log_dir else None
    start = log.stat().st_size if log else 0
    if sink is not None:
        sink.drain()  # what came before this run
        t0 = time.time_ns()
    out = await _load_with_cpu(spec, path)
    if log is not None:
        await asyncio.sleep(0.2)  # the last request's timing lines follow its final event
        out["metrics"].update(server_log.slice_metrics(log, start, log.stat().st_size))
    if sink is not None:
        await asyncio.sleep(0.5)  # the processes export in batches (OTEL_BSP_SCHEDULE_DELAY 50 ms)
        rows = [r for r in timeline.timelines(sink.drain()) if r["arrive_ns"] >= t0]
        out["metrics"].update(timeline.summarize(rows))
        if traced is not None:
            traced.append(rows)
    return out


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_server_parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=["greedy", "t1"])
    ap.add_argument("--apis", nargs="+", choices=["completions", "chat"], default=["completions"])
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="completions prompt length in tokens")
    ap.add_argument("--think-ms", type=float, nargs="+", default=[0.0], help=(
        "closed loop: each client's mean wait between an answer and its next request (uniform, 0 to twice it), one "
        "set of cells per value; 0: at once. A client that sends at once reaches llama-server in the gap after the "
        "step that ended its last request, one a hop later misses it and waits a step: think time randomizes that"))
    ap.add_argument("--requests-per-client", type=int, default=3, help="requests per client per run")
    ap.add_argument("--min-requests", type=int, default=8, help="at least this many requests per run")
    ap.add_argument("--duration", type=float, default=300.0, help="cap on seconds of load per run")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request")
    ap.add_argument("--model", default="gemma-3-270m",
                    help="the model Pulse serves: a bundled model's name or a GGUF path")
    ap.add_argument("--queue-deadline", type=float, default=None,
                    help="Pulse's admission.queue_deadline_s (default: Pulse's, 30 s)")
    ap.add_argument("--slots", type=int, default=None, help="llama-server -np (default: the device profile's)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="llama-server -c (default: the profile's)")
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t (default: Pulse's)")
    ap.add_argument("--gateway-replicas", type=int, default=None,
                    help="pulse serve's gateway_replicas (default: from the box's cores, as shipped: 1 on 2 cores, "
                    "4 on 16), e.g. 4 on a small box to see the replicas' hand-overs the 16-core host has")
    ap.add_argument("--binary", default=None, help="llama-server to run (default: Pulse's cached build)")
    ap.add_argument("--slot-affinity", choices=["on", "off"], default="on",
                    help="off: Pulse sends no id_slot and llama-server picks each slot "
                    "(workers.llama_server.slot_affinity)")
    ap.add_argument("--variants", nargs="+", default=[""], metavar="FLAGS",
                    help="one pulse serve + llama-server per entry, these llama-server flags added (after "
                    "--server-args), all interleaved in one run; '' is the configuration as it is; '=FLAGS' replaces "
                    "the device profile's flags with FLAGS")
    ap.add_argument("--variant-binaries", nargs="+", default=[], metavar="PATH",
                    help="per variant, in --variants' order, the llama-server it runs ('' or missing: --binary's)")
    ap.add_argument("--variant-worker-queues", nargs="+", default=[], metavar="N",
                    help="per variant, in --variants' order, Pulse's admission.worker_queue_max: requests it sends "
                    "beyond llama-server's slots ('' or missing: what the worker says)")
    ap.add_argument("--variant-holds", nargs="+", default=[], metavar="MS",
                    help="per variant, in --variants' order, the worker's workers.llama_server.hold_ms ('' or "
                    "missing: Pulse's default), e.g. --variants '' '' --variant-holds '' 0")
    ap.add_argument("--variant-configs", nargs="+", default=[], metavar="JSON",
                    help="per variant, in --variants' order, Pulse settings as JSON merged over the rest ('' or "
                    "missing: none), e.g. --variants '' '' --variant-configs '' '{\"admission\": "
                    "{\"gateway_order_s\": null}}' (the order across gateway replicas against none)")
    ap.add_argument("--server-args", default="",
                    help="more llama-server flags, one string (workers.llama_server.extra_args; later flags win), "
                    "e.g. --server-args='--cache-ram 0'")
    ap.add_argument("--trace", action="store_true",
                    help="export Pulse's spans to a receiver in the bench: where each run's TTFT went "
                    "(trace_* metrics)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--loop", choices=loops.CHOICES, default="auto", help="the load generator's event loop")
    protocol.add_arguments(ap, RESULTS)
    args = ap.parse_args(argv)
    if len(args.variant_binaries) > len(args.variants):
        ap.error("--variant-binaries names more binaries than there are --variants")
    if len(args.variant_worker_queues) > len(args.variants):
        ap.error("--variant-worker-queues names more queues than there are --variants")
    if any(q and not q.isdigit() for q in args.variant_worker_queues):
        ap.error("--variant-worker-queues takes whole numbers or ''")
    if len(args.variant_holds) > len(args.variants):
        ap.error("--variant-holds names more holds than there are --variants")
    try:
        [float(h) for h in args.variant_holds if h]
    except ValueError:
        ap.error("--variant-holds takes milliseconds or ''")
    if len(args.variant_configs) > len(args.variants):
        ap.error("--variant-configs names more configs than there are --variants")
    try:
        args.variant_configs = [json.loads(c) if c else {} for c in args.variant_configs]
    except ValueError as e:
        ap.error(f"--variant-configs takes JSON objects or '': {e}")
    if any(not isinstance(c, dict) for c in args.variant_configs):
        ap.error("--variant-configs takes JSON objects or ''")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    machine, started = checked_machine_info(), time.time()
    log_dir = args.out / f"logs-parity-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with owned_processes() as procs, contextlib.ExitStack() as stack:
        sink = stack.enter_context(OtlpSink()) if args.trace else None
        cells, runs, servers, log_lines, traced = {}, {}, [], [], {}
        ids = prompt_ids(args.prompt_tokens, args.model)
        for v, flags in enumerate(args.variants):
            vdir = log_dir / f"v{v}" if len(args.variants) > 1 else log_dir
            vdir.mkdir(parents=True, exist_ok=True)
            binary = args.variant_binaries[v] if v < len(args.variant_binaries) else None
            queue = args.variant_worker_queues[v] if v < len(args.variant_worker_queues) else ""
            hold = args.variant_holds[v] if v < len(args.variant_holds) else ""
            more = args.variant_configs[v] if v < len(args.variant_configs) else {}
            config = config_yaml(args, vdir, flags, binary, int(queue) if queue else None,
                                 float(hold) if hold else None, more)
            pulse, pulse_url, llama_pid, llama_port = start_pulse(config, vdir, procs, args.start_timeout,
                                                                  sink.env() if sink else None)
            paths = {target("direct", v): [Pid(llama_pid)], target("pulse", v): [pulse]}
            vcells = specs(args, ids, pulse_url, first_model(pulse_url), f"http://127.0.0.1:{llama_port}", v)
            cells |= vcells
            for name, s in vcells.items():
                tgt = name.split("/")[0]
                traced_cell = sink is not None and tgt == target("pulse", v)  # direct's requests make no spans
                sink_of, rows_of = (sink, traced.setdefault(name, [])) if traced_cell else (None, None)
                runs[name] = functools.partial(_measure, s, paths[tgt], pulse, vdir, sink_of, rows_of)
            label = flags + (f" [worker_queue_max {queue}]" if queue else "") + (f" [hold_ms {hold}]" if hold else "") \
                + (f" [{json.dumps(more)}]" if more else "")
            servers.append((v, label, llama_pid, vdir))
        # SIGINT (bench/gpu_parity.sh's time limit) ends the runs; the ones that ended are summarized
        records, cut = protocol.run_to_limit(runs, args.repeats, args.warmup, not args.quiet, args.loop)
        interrupted = [f"{cut}: cells with no measured run are missing"] if cut else []
        summary = summarize(records, list(cells))
        params = vars(args) | {"loop": loops.resolve(args.loop), "llama_servers": []}
        for v, flags, llama_pid, vdir in servers:
            argv = Path(f"/proc/{llama_pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            launches = server_log.summarize([launch for log in sorted(vdir.glob("llama-server-*.log"))
                                             for launch in server_log.parse_file(log)])
            # launches: warm-up included, the whole process's life
            params["llama_servers"].append({"variant": v, "flags": flags, "pid": llama_pid, "argv": argv,
                                            "launches": launches})
            log_lines += [f"variant {v} ({flags or 'as configured'}): {line}" for line in server_log.lines(launches)]
        for name, per_run in traced.items():  # warm-up included: every run's own line, and its rows in the logs
            log_lines += [line for i, rows in enumerate(per_run) for line in timeline.lines(rows, f"{name} run {i}: ")]
            for i, rows in enumerate(per_run):
                (log_dir / f"trace-{name.replace('/', '_')}-run{i}.json").write_text(json.dumps(rows, indent=0))
        protocol.publish("llama_server_parity", records, summary, params, started, machine,
                         verdict(summary) + log_lines + interrupted,
                         TABLE_METRICS + (TRACE_METRICS if args.trace else []), PLOT_METRICS, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
