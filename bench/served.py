"""The served path as users see it: `pulse serve` and llama-server direct, on the same machine and model,
streaming, at the settings users send.

    python -m bench.served --model MODEL.gguf --llama-server BIN --clients 1 8 32 64 --tokens 128 \
        --workloads story code json --sampling greedy t1 --repeats 3 --warmup 1

Targets (`--targets`): `pulse` (pulse serve, the CuPy engine, the device profile's speculation, each sequence's
depth adapting to its acceptance), `pulse-k0` (the same server, `max_draft_tokens: 0`: no speculation), `pulse-k8`
(the same server, each request `max_draft_tokens: 8`: the h200 profile's cap before it drafted up to 16 at 1-4
streams), `pulse-inproc` (a second `pulse serve` like `pulse`, its engine's step thread in the worker's own process:
`workers.engine.process: off`, the placement before the engine process), `pulse-w0` (a second `pulse serve` like
`pulse` whose scheduler admits every arrival at once, `prefill_wait_steps: 0`; with `--prefill-wait N` for `pulse`,
the A/B of prefill coalescing, workers/cupy/scheduler.py), `pulse-serial` (a second `pulse serve` like `pulse` with
`workers.engine.overlap: off`: each engine step read before the next is launched), `pulse-eager` (a second `pulse
serve` like `pulse` with `workers.engine.mixed_graphs: off`: a step that carries a prompt chunk launched eagerly
instead of replaying the verify graphs, workers/cupy/gpu/verify.py), `pulse-fit` (a second `pulse serve` like
`pulse` with `workers.engine.fit_graphs: on`: requests arriving beside decodes join a step only up to the largest
mixed graph's tokens, the rest a step later, workers/cupy/scheduler.py), `pulse-hold` (a second `pulse serve` like
`pulse` whose engine holds step outputs 200 us a stream before handing them to the worker's streams,
`workers.engine.handover_us_per_stream`; the default is 50), `pulse-q4` (a second `pulse serve` like `pulse` with
`admission.worker_queue_max: 4`, the default before the h200 profile's `worker_queue: 128`: beside `pulse`, the A/B
of letting the worker hold requests beyond its batch, so that a finished sequence's place is refilled inside the
engine rather than after the gateway hears of the end; `--worker-queue N` sets `pulse`'s), `pulse-bN` (e.g.
`pulse-b192`: a second `pulse serve` like `pulse` whose engine runs at most N sequences a step, `max_num_seqs: N`;
with `--profile-batch`, beside `pulse`, the served A/B of the profile's batch size), `pulse-qgc` (a second `pulse
serve` like `pulse` whose engine process freezes the built engine out of garbage collection,
`workers.engine.quiet_gc: on`: the A/B of that setting, off by default since it served no faster on the H200),
`pulse-w2` (a second `pulse serve` like `pulse` with two workers sharing the GPU, `workers.count: 2`, each with its
own engine process and the profile's batch: where the served step is bound by one engine's host work, the A/B of a
second host thread on the same device; at 256 clients each runs ~128 sequences, past 512 up to twice `pulse`'s
batch in all), `pulse-att` (a second `pulse serve` like `pulse` whose processes compile the attention kernel with
`--att-variant`'s PULSE_GPU_ATT_* settings, e.g. "MIN_BLOCKS=2 UNROLL=2": a kernel variant served beside the default;
bench/attention_gpu.py measures its device time alone), `pulse-base` (a second `pulse serve` like `pulse` run from
another commit's tree, `--base-tree`, e.g. `.base` as `BASE=REV bash bench/gpu_clean_copy.sh` archives it beside the
tree: that commit's code served in the same repeats as this one's, the A/B of a change to the engine or the gateway),
`llama` (llama-server started directly with the device profile's flags, -ngl 99 and one slot per client). Workloads:
`story` (a distinct short-story prompt per request), `code` (a code edit: a file plus an instruction to rewrite it,
distinct per request), `json` (chat with a JSON-schema `response_format`). Sampling: `greedy` (temperature 0) and
`t1` (temperature 1, no top_k / top_p: OpenAI's default). Each run: C clients, each sending --per-client requests in
a closed loop, `ignore_eos` so every request generates --tokens tokens; `--stagger S` spreads the clients' first
requests over S seconds, so that requests end and arrive spread over the run as independent agents' do (without it
they start, end and re-arrive together, and few steps carry a prompt; the engine alone then runs with staggered
arrivals too). The whole grid is large (3 targets x 3 workloads x 2 samplings x 4 client counts = 72 runs a repeat;
on the H200 one warm-up and two repeats of it at one request per client did not fit in 9 minutes, llama-server's 32-
and 64-client runs the longest): on a time-limited machine run a part of it per call (--workloads / --targets);
every run's result is appended to records.jsonl in the log folder as it lands. Metrics: aggregate tok/s (generated
tokens over the run's wall time), TTFT p50 / p99, and for Pulse's GPU engine `eager_share`: the run's engine
forwards that ran eagerly (a step no CUDA graph fits: a long prompt, or any prompt with `pulse-eager`'s mixed graphs
off) over all its forwards, from the workers' `forwards_by_path`, `batch_mean` (decoding sequences per forward:
whether the batch stays full past saturation), `steps_per_s` (forwards over the run's wall time: whether the steps
slowed), `gc_share` (the seconds the engine's process spent in garbage collection, which stops its step thread, over
the run's wall time), `step_busy` (the engine's step thread's time in steps over the run's wall time) and
`wait_share` (of that step time, the part spent getting each step's tokens, i.e. waiting for the device: near 1 the
device bounds the served steps, near 0 the host's own work per step does). Every configuration runs once per repeat,
interleaved, reversed and rotated (bench/protocol.py); JSON, a Markdown table and a PNG go to --out, and the pivot
table (one row per workload x sampling x clients) is printed. `--engine-alone` then runs, in the same call once the
servers are stopped, the worker's engine alone at the same batches, story prompts and sampling
(bench/engine_batches.py, no HTTP): its `engine` column is the ceiling the served path is measured against
(`pulse/engine`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import loops, protocol
from bench.loadgen import LoadSpec, run_load
from bench.machine import REPO, machine_info
from bench.procs import Served, owned_processes, python_module
from bench.speculation import EDITS, SOURCES, edit_prompt

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLING = {"greedy": {"temperature": 0.0}, "t1": {"temperature": 1.0}}
TABLE_METRICS = ["tok_s", "ttft_p50_ms", "ttft_p99_ms", "ok", "errors", "rate_limited", "eager_share", "batch_mean",
                 "steps_per_s", "gc_share", "step_busy", "wait_share", "client_cpu"]
SEQ_STEPS = "_seq_steps"  # forwards()' key for the decoding sequence-steps beside the forwards by path
GC_SECONDS = "_gc_seconds"  # forwards()' key for the seconds the engines' processes spent in garbage collection
STEP_SECONDS = "_step_seconds"  # forwards()' key for the seconds the engines' step threads spent in steps
WAIT_SECONDS = "_token_wait_seconds"  # ... and of them, getting each step's tokens (waiting on the device)
ATTENTION = "_attention"  # forwards()' key for the attention kernel's settings a worker compiled (not summed)
PHASE = "_phase:"  # forwards()' key prefix for the step threads' seconds by part of a step (Engine.phase_seconds)
STATS_POLL_S = 0.5  # the gateway's worker stats poll (gateway/pool.py WorkerPool's poll_interval_s)
PLOT_METRICS = ["tok_s", "ttft_p50_ms"]
SUBJECTS = ("a lighthouse keeper", "a lost robot", "two rival bakers", "a dragon who hates fire", "a night train",
            "a retired astronaut", "a talking cat", "a city under the sea", "a clockmaker's apprentice",
            "a haunted library", "a desert caravan", "a chess prodigy", "a forgotten island", "a jazz drummer")
PLACES = ("in winter", "at dawn", "during a storm", "on the last day of summer", "in a distant future")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "species": {"type": "string"},
                                           "age": {"type": "integer"}, "habitat": {"type": "string"},
                                           "traits": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "species", "age", "habitat", "traits"]}


def prompts(workload: str, n: int) -> tuple[str, list[str]]:
    """(api, n distinct prompts): distinct so no request rides another's cached prefix."""
    if workload not in WORKLOAD_API:
        raise ValueError(f"unknown workload {workload!r}")
    return WORKLOAD_API[workload], [prompt_at(workload, i) for i in range(n)]


WORKLOAD_API = {"story": "completions", "code": "completions", "json": "chat"}


def prompt_at(workload: str, i: int) -> str:
    """The i-th prompt of a workload (prompts(workload, n)[1][i])."""
    if workload == "story":
        return (f"Story {i}. Write a long story about {SUBJECTS[i % len(SUBJECTS)]} "
                f"{PLACES[i // len(SUBJECTS) % len(PLACES)]}.\n\n")
    if workload == "code":
        names = list(SOURCES)
        name = names[i % len(names)]
        return edit_prompt(name, SOURCES[name], EDITS[name], f"Ticket {i}. ")
    if workload == "json":
        return (f"Request {i}: describe a fictional animal living {PLACES[i % len(PLACES)]} near "
                f"{SUBJECTS[i % len(SUBJECTS)]}, as JSON.")
    raise ValueError(f"unknown workload {workload!r}")


def body_extra(target: str, workload: str, sampling: str) -> dict:
    extra = dict(SAMPLING[sampling], ignore_eos=True)
    if target in ("pulse-k0", "pulse-k8"):
        extra["max_draft_tokens"] = int(target[len("pulse-k"):])
    if workload == "json":
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA}}
    return extra


def config_name(target: str, workload: str, sampling: str, clients: int) -> str:
    return f"{target}/{workload}/{sampling}/c{clients}"


def make_measure(args, base: str, model: str, target: str, workload: str, sampling: str, clients: int, salt,
                 partial: Path):
    """One configuration's run; each result is also appended to `partial` (JSON lines) and printed as it
    lands, so a run stopped early (a device call's time limit) keeps what it measured."""
    n = clients * args.per_client
    name = config_name(target, workload, sampling, clients)

    async def measure() -> dict:
        offset = next(salt) * n  # each run its own prompts: a repeat never hits an earlier run's cache
        api, texts = prompts(workload, offset + n)
        spec = LoadSpec(url=base, api=api, model=model, prompts=texts[offset:], max_tokens=args.tokens,
                        clients=clients, requests=n, duration=args.duration, timeout=args.timeout,
                        stagger_s=args.stagger, procs=args.client_procs,
                        body_extra=body_extra(target, workload, sampling),
                        # llama-server direct: a connection per request, as bench/llama_server_parity.py and
                        # Pulse's own backend do (cpp-httplib dropped kept-alive ones: with 2 requests per client
                        # about half the second ones failed with ServerDisconnectedError, 2026-12-02 on the H200)
                        force_close=target == "llama")
        before = await asyncio.to_thread(forwards, base)
        out = await run_load(spec)
        m = out["metrics"]
        if before:  # a Pulse GPU worker: the share of this run's forwards that ran eagerly (no graph)
            await asyncio.sleep(2 * STATS_POLL_S)  # the gateway's view of the workers lags one stats poll
            after = await asyncio.to_thread(forwards, base)
            before.pop(ATTENTION, None)
            if ATTENTION in after:  # which attention kernel served the run (pulse-att's variant, or the defaults)
                m["attention"] = after.pop(ATTENTION)
            delta = {k: after.get(k, 0) - v for k, v in before.items()}
            seq_steps = delta.pop(SEQ_STEPS, 0)
            gc_s = delta.pop(GC_SECONDS, 0.0)
            step_s, wait_s = delta.pop(STEP_SECONDS, 0.0), delta.pop(WAIT_SECONDS, 0.0)
            phases = {k[len(PHASE):]: delta.pop(k) for k in [k for k in delta if k.startswith(PHASE)]}
            total = sum(delta.values())
            m["forwards"], m["eager_share"] = total, (delta.get("eager", 0) / total if total > 0 else None)
            # past saturation: is the engine's batch kept full (decoding sequences a step) and how fast does it step
            m["batch_mean"] = seq_steps / total if total > 0 and seq_steps else None
            m["steps_per_s"] = total / m["wall_s"] if m.get("wall_s") else None
            # the share of the run's wall time the engines' processes spent collecting garbage (every thread stopped)
            m["gc_share"] = gc_s / m["wall_s"] if m.get("wall_s") else None
            # how busy the step threads were (their step time over the wall time; > 1 with several workers), and the
            # share of that time spent waiting for steps' tokens: near 1 the device bounds the steps, near 0 the host
            m["step_busy"] = step_s / m["wall_s"] if m.get("wall_s") and step_s else None
            m["wait_share"] = wait_s / step_s if step_s > 0 else None
            # the step thread's time by part of a step (and between steps), each over the run's wall time: where a
            # host-bound step goes (the token wait is wait_share x step_busy; the rest of step_busy is unnamed)
            if phases and m.get("wall_s"):
                m["phases"] = {k: v / m["wall_s"] for k, v in phases.items()}
        with partial.open("a") as f:
            f.write(json.dumps({"config": name, "time": time.time(), **out}) + "\n")
        print(f"{name}: {m['tok_s']:.0f} tok/s, TTFT p50 {m['ttft_p50_ms'] or 0:.1f} ms, ok {m['ok']}/{m['requests']}, "
              f"client CPU {m.get('client_cpu') or 0:.2f} cores", flush=True)
        if m.get("phases"):  # the engine step thread's time by part, shares of the wall time
            print(f"  step thread: busy {m.get('step_busy') or 0:.2f}, waiting on the device "
                  f"{(m.get('step_busy') or 0) * (m.get('wait_share') or 0):.2f}; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in m["phases"].items()), flush=True)
        return out

    return measure


def forwards(base: str) -> dict[str, int]:
    """The GPU engines' forwards by path (graph / verify / mixed / eager), summed over the workers as the gateway last
    polled them (GET /pulse/workers, open on loopback), and under SEQ_STEPS the decoding sequence-steps they ran (the
    speculator's steps_by_k, counted at every K including 0); {} where there are none (llama-server, a CPU engine)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/pulse/workers", timeout=10) as r:
            workers = json.load(r)["workers"]
    except (OSError, ValueError, KeyError):
        return {}
    total: dict[str, int] = {}
    for w in workers:
        stats = w.get("stats", {})
        for path, n in (stats.get("forwards_by_path") or {}).items():
            total[path] = total.get(path, 0) + n
        if stats.get("forwards_by_path"):
            total[SEQ_STEPS] = total.get(SEQ_STEPS, 0) + sum(stats.get("steps_by_k") or ())
            total[GC_SECONDS] = total.get(GC_SECONDS, 0.0) + (stats.get("gc_seconds") or 0.0)
            total[STEP_SECONDS] = total.get(STEP_SECONDS, 0.0) + (stats.get("step_seconds") or 0.0)
            total[WAIT_SECONDS] = total.get(WAIT_SECONDS, 0.0) + (stats.get("token_wait_seconds") or 0.0)
            for name, sec in (stats.get("step_phase_seconds") or {}).items():
                total[PHASE + name] = total.get(PHASE + name, 0.0) + sec
            if stats.get("attention_settings"):
                total[ATTENTION] = stats["attention_settings"]
    return total


def counter():
    i = 0
    while True:
        yield i
        i += 1


def pulse_config(args, port: int, log_dir: Path, process: str = "auto", name: str = "", admission: dict | None = None,
                 workers: int = 1, **engine) -> Path:
    """`process`: workers.engine.process (auto: the engine in a process of its own on a GPU; "off" for the
    pulse-inproc target, the engine's step thread in the worker's process as before that split); `admission`:
    admission settings (--worker-queue); `engine`: more workers.engine settings (the pulse-w0 target's
    prefill_wait_steps); `workers`: workers.count (2 for pulse-w2: two engines sharing the GPU)."""
    cfg = {"server": {"port": port, "host": "127.0.0.1"},
           "workers": {"backend": "cupy", "count": workers,
                       "engine": {"device": args.device, "process": process,
                                  **({} if args.profile_batch else {"max_num_seqs": max(args.clients)}), **engine}},
           "keys": {"file": str(log_dir / "keys.json")}, "telemetry": {"log_level": "WARNING"}}
    if admission:
        cfg["admission"] = admission
    if args.profile:
        cfg["workers"]["device_profile"] = args.profile
    if args.model:
        cfg["model"] = {"path": args.model}
    path = log_dir / f"pulse-{name or process}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def llama_argv(args, port: int) -> list[str]:
    """llama-server with the device profile's flags, every layer on the GPU and a slot per client."""
    from policy.profiles import builtin_profiles

    flags = builtin_profiles()[args.profile or "h200"].llama_server_args
    slots = max(args.clients)
    return [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-ngl", "99",
            "-np", str(slots), "-c", str(slots * args.slot_tokens), *flags, *args.llama_args.split()]


def first_model(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def start(args, log_dir: Path, procs: list) -> dict[str, tuple[str, str]]:
    """{target: (base URL, model id)}; servers started and healthy."""
    bases = {}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    # pulse, pulse-k0 and pulse-k8 share one `pulse serve`; pulse-inproc has its own with the engine in the worker's
    # process, pulse-w0 its own without prefill coalescing, pulse-serial its own with the engine's overlap off,
    # pulse-eager its own with mixed steps launched eagerly, pulse-fit its own with arrivals fitted to the graphs
    # (workers.engine.fit_graphs on), pulse-hold its own with a 200 us hand-over hold,
    # pulse-q4 its own with a worker queue of 4 (--worker-queue sets pulse's; unset, the profile's), each pulse-bN its
    # own with a batch of N (and pulse's worker queue), pulse-qgc its own with quiet_gc on, pulse-att its own with
    # the attention kernel's --att-variant (environment variables: Ray's workers and the engine process inherit them)
    queue = {} if args.worker_queue is None else {"worker_queue_max": args.worker_queue}
    for name, process, admission, engine, targets in (
            (args.engine_process, args.engine_process, queue,
             {} if args.prefill_wait is None else {"prefill_wait_steps": args.prefill_wait},
             [t for t in args.targets if t in ("pulse", "pulse-k0", "pulse-k8")]),
            ("off", "off", {}, {}, [t for t in args.targets if t == "pulse-inproc"]),
            ("w0", args.engine_process, {}, {"prefill_wait_steps": 0}, [t for t in args.targets if t == "pulse-w0"]),
            ("serial", args.engine_process, {}, {"overlap": "off"}, [t for t in args.targets if t == "pulse-serial"]),
            ("eager", args.engine_process, {}, {"mixed_graphs": False},
             [t for t in args.targets if t == "pulse-eager"]),
            ("fit", args.engine_process, queue, {"fit_graphs": True},
             [t for t in args.targets if t == "pulse-fit"]),
            ("hold", args.engine_process, {}, {"handover_us_per_stream": 200.0},
             [t for t in args.targets if t == "pulse-hold"]),
            ("q4", args.engine_process, {"worker_queue_max": 4}, {}, [t for t in args.targets if t == "pulse-q4"]),
            ("qgc", args.engine_process, queue, {"quiet_gc": True}, [t for t in args.targets if t == "pulse-qgc"]),
            ("att", args.engine_process, queue, {}, [t for t in args.targets if t == "pulse-att"]),
            ("w2", args.engine_process, queue, {}, [t for t in args.targets if t == "pulse-w2"]),
            ("base", args.engine_process, queue, {}, [t for t in args.targets if t == "pulse-base"]),
            *((t[len("pulse-"):], args.engine_process, queue, {"max_num_seqs": batch_of(t)}, [t])
              for t in args.targets if batch_of(t))):
        if not targets:
            continue
        served = Served(procs, f"pulse-{name}", lambda port: python_module(
            "pulse.cli", "serve", "--config",
            str(pulse_config(args, port, log_dir, process, name, admission, workers=2 if name == "w2" else 1,
                             **engine))), log_dir,
            **target_env(name, env, args))
        base = served.ready(args.start_timeout)
        for t in targets:
            bases[t] = (base, first_model(base))
    if "llama" in args.targets:
        served = Served(procs, "llama-server", lambda port: llama_argv(args, port), log_dir)
        bases["llama"] = (served.ready(args.start_timeout), "llama")
    return bases


def pivot(summary: dict, args) -> str:
    """Markdown: one row per workload x sampling x clients, tok/s and TTFT p50 / p99 per target."""
    head = ["workload", "sampling", "clients"] + [f"{t} {m}" for t in args.targets
                                                 for m in ("tok/s", "TTFT p50 ms", "TTFT p99 ms")]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for w in args.workloads:
        for s in args.sampling:
            for c in args.clients:
                cells = [w, s, str(c)]
                for t in args.targets:
                    m = summary.get(config_name(t, w, s, c), {})
                    cells += [_cell(m.get("tok_s"), 0), _cell(m.get("ttft_p50_ms"), 1), _cell(m.get("ttft_p99_ms"), 1)]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(s, digits: int) -> str:
    if not s:
        return "–"
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}–{s['max']:,.{digits}f})"


def ratios(summary: dict, args, num: str, den: str) -> list[str]:
    """Per workload x sampling x clients, num's median tok/s over den's."""
    out = []
    for w in args.workloads:
        for s in args.sampling:
            for c in args.clients:
                a = summary.get(config_name(num, w, s, c), {}).get("tok_s")
                b = summary.get(config_name(den, w, s, c), {}).get("tok_s")
                if a and b and b["median"] > 0:
                    out.append(f"{num}/{den} {w} {s} c{c}: {a['median'] / b['median']:.2f}x")
    return out


TARGETS = ["pulse", "pulse-k0", "pulse-k8", "pulse-inproc", "pulse-w0", "pulse-serial", "pulse-eager", "pulse-fit",
           "pulse-hold", "pulse-q4", "pulse-qgc", "pulse-att", "pulse-w2", "pulse-base", "llama"]


def target_env(name: str, env: dict, args) -> dict:
    """Served's `env` and `cwd` for the `pulse serve` of target pulse-`name`: pulse-att's kernel settings; pulse-base
    started in --base-tree with that tree first on the path (python -m puts the working directory first, and Ray's
    workers and the engine process inherit both), so that every process it starts runs that tree's code."""
    if name == "att":
        return {"env": {**env, **att_env(args.att_variant)}}
    if name != "base":
        return {"env": env}
    base = Path(args.base_tree or "").resolve()
    if not args.base_tree or not (base / "pulse" / "cli.py").is_file():
        raise SystemExit(f"pulse-base needs --base-tree: a tree with pulse/cli.py (got {args.base_tree!r})")
    return {"env": {**env, "PYTHONPATH": os.pathsep.join([str(base), *env["PYTHONPATH"].split(os.pathsep)[1:]])},
            "cwd": base}


def att_env(variant: str) -> dict[str, str]:
    """"MIN_BLOCKS=2 UNROLL=2" -> {"PULSE_GPU_ATT_MIN_BLOCKS": "2", "PULSE_GPU_ATT_UNROLL": "2"}."""
    out = {}
    for item in variant.split():
        key, eq, val = item.partition("=")
        if not (eq and key.isidentifier() and val):
            raise ValueError(f"--att-variant: {item!r} is not KEY=VALUE")
        out[f"PULSE_GPU_ATT_{key}"] = val
    return out


def batch_of(target: str) -> int | None:
    """N for a `pulse-bN` target (its engine's max_num_seqs), else None."""
    m = re.fullmatch(r"pulse-b([1-9][0-9]*)", target)
    return int(m.group(1)) if m else None


def target_name(value: str) -> str:
    if value in TARGETS or batch_of(value):
        return value
    raise argparse.ArgumentTypeError(f"unknown target {value!r} (one of {', '.join(TARGETS)}, or pulse-bN)")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (llama-server needs one); empty: Pulse's bundled model")
    ap.add_argument("--llama-server", help="llama-server binary for the `llama` target")
    ap.add_argument("--targets", nargs="+", default=["pulse", "pulse-k0", "llama"], type=target_name, help=(
        f"{', '.join(TARGETS)}, or pulse-bN (a batch of N): the module's docstring"))
    ap.add_argument("--workloads", nargs="+", default=["story", "code", "json"], choices=["story", "code", "json"])
    ap.add_argument("--sampling", nargs="+", default=["greedy", "t1"], choices=list(SAMPLING))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of every request (ignore_eos)")
    ap.add_argument("--per-client", type=int, default=2, help="requests per client per run")
    ap.add_argument("--stagger", type=float, default=0.0, help=(
        "seconds over which the clients' first requests are spread (client i starts at i x S / C), so that requests "
        "end and arrive spread over the run as independent agents' do; 0: all at once (their requests then end and "
        "re-arrive together, so few steps carry a prompt). tok/s still counts the whole run, the ramp included"))
    ap.add_argument("--duration", type=float, default=60.0, help="cap on seconds of load per run")
    ap.add_argument("--client-procs", type=int, default=1, help=(
        "load-generator processes the clients are spread over: one process parsing the streams in one event loop "
        "tops out near one core at ~1,000 streams, and then limits the figures (see client_cpu)"))
    ap.add_argument("--timeout", type=float, default=120.0, help="per request")
    ap.add_argument("--device", default="auto", help="the Pulse engine's device")
    ap.add_argument("--profile-batch", action="store_true", help=(
        "keep the device profile's max_num_seqs (default: the largest client count, so that nobody queues); "
        "with it, clients beyond the batch wait in the gateway's admission queue as they would in production"))
    ap.add_argument("--engine-process", default="auto", choices=["auto", "on", "off"],
                    help="workers.engine.process for the pulse and pulse-k0 targets (auto: on with a GPU engine)")
    ap.add_argument("--prefill-wait", type=int, help=(
        "workers.engine.prefill_wait_steps for the pulse and pulse-k0 targets (default: the profile's); beside "
        "pulse-w0 (0) it is the A/B of prefill coalescing"))
    ap.add_argument("--worker-queue", type=int, help=(
        "admission.worker_queue_max for the pulse and pulse-k0 targets (default: unset, so the device profile's "
        "worker_queue, else 4): requests a worker is sent beyond its batch; pulse-q4 runs with 4"))
    ap.add_argument("--base-tree", default=os.environ.get("BENCH_BASE_TREE") or (
        str(REPO / ".base") if (REPO / ".base").is_dir() else ""), help=(
        "target pulse-base: another commit's tree to serve from (default: $BENCH_BASE_TREE, else .base when there)"))
    ap.add_argument("--att-variant", default=os.environ.get("BENCH_ATT_VARIANT", ""), help=(
        "the pulse-att target's attention kernel: PULSE_GPU_ATT_* settings without the prefix, e.g. "
        "'MIN_BLOCKS=2 UNROLL=2' (workers/cupy/gpu/kernels.py; default: $BENCH_ATT_VARIANT)"))
    ap.add_argument("--profile", help="device profile (default: detected)")
    ap.add_argument("--slot-tokens", type=int, default=4096, help="llama-server KV tokens per slot")
    ap.add_argument("--llama-args", default="", help=(
        "more llama-server flags for the `llama` target, one string (e.g. '--backend-sampling': llama.cpp's "
        "experimental sampling on the GPU; without it llama-server samples on the CPU, one thread for all "
        "slots, over the whole vocabulary)"))
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--loop", choices=loops.CHOICES, default="auto", help="the load generator's event loop")
    ap.add_argument("--engine-alone", action="store_true", help=(
        "after the served runs, the engine alone at the same batches (bench/engine_batches.py; story prompts)"))
    protocol.add_arguments(ap, RESULTS)
    args = ap.parse_args(argv)
    if "llama" in args.targets and not (args.llama_server and args.model):
        ap.error("the llama target needs --llama-server and --model")
    if args.engine_alone and "story" not in args.workloads:
        ap.error("--engine-alone measures the story workload: include it in --workloads")
    return args


def engine_alone(args, log_dir: Path) -> dict:
    """bench/engine_batches.py in its own process (the servers are stopped, the GPU is free): its summaries
    keyed as the `engine` target's story configurations."""
    import subprocess

    out = log_dir / "engine_alone.json"
    argv = [sys.executable, "-m", "bench.engine_batches", "--batches", *map(str, args.clients), "--sampling",
            *args.sampling, "--tokens", str(args.tokens), "--per-client", str(args.per_client), "--repeats",
            str(args.repeats), "--device", args.device, "--json", str(out)]
    argv += ["--model", args.model] if args.model else []
    argv += ["--profile", args.profile] if args.profile else []
    argv += [] if "pulse" in args.targets else ["--no-speculation"]  # like for like with pulse-k0 alone
    argv += ["--arrivals", "staggered"] if args.stagger > 0 else []  # spread arrivals there too
    # SIGINT (the time limit) stops it as it would have stopped this process: served.py ignores SIGINT by now
    done = subprocess.run(argv, cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if done.returncode != 0:
        print(f"the engine alone stopped with exit code {done.returncode}: no engine column", file=sys.stderr)
        return {}
    cells = json.loads(out.read_text())["cells"]
    out = {}
    for s in args.sampling:
        for c in args.clients:
            key = f"{s}/b{c}" if args.stagger <= 0 else next(
                (k for k in cells if k.startswith(f"{s}/b{c}/staggered/")), None)
            if key in cells:
                out[config_name("engine", "story", s, c)] = {"tok_s": cells[key]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    machine, started = machine_info(), time.time()
    log_dir = args.out / f"served-logs-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with owned_processes() as procs:
        bases = start(args, log_dir, procs)
        salt, partial = counter(), log_dir / "records.jsonl"
        measures = {config_name(t, w, s, c): make_measure(args, *bases[t], t, w, s, c, salt, partial)
                    for w in args.workloads for s in args.sampling for c in args.clients for t in args.targets}
        # SIGINT (bench/gpu_served.sh's time limit) ends the runs; the ones that ended are summarized, and a second
        # SIGINT while the servers stop is ignored (2026-12-04 on the H200: all 36 runs of a call measured, no table);
        # `timeout -k` still kills
        records, interrupted = protocol.run_to_limit(measures, args.repeats, args.warmup, not args.quiet, args.loop)
    summary = protocol.summarize(records)
    if args.engine_alone and not interrupted:
        summary.update(engine_alone(args, log_dir))
        args.targets = [*args.targets, "engine"]
    verdict = [pivot(summary, args), ""] + ([f"{interrupted}: cells with no measured run are missing", ""]
                                           if interrupted else [])
    for num in ("pulse", "pulse-k0"):
        if num in args.targets:
            for other in args.targets:
                if other not in (num, "pulse"):
                    verdict += ratios(summary, args, num, other)
    protocol.publish("served", records, summary, vars(args), started, machine, verdict, TABLE_METRICS,
                     PLOT_METRICS, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
