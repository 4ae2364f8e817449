"""What `pulse serve` costs the box while it serves nothing: CPU per process, idle, as % of one core.

On a small box every idle cycle of Pulse's and Ray's processes is taken from what the backend would use (a
llama-server decoding on both cores of the 2-core box). Per repeat and per variant this starts `pulse serve`
(the load-test backend unless told otherwise), waits until it is healthy and `--settle` seconds more, reads
every process's CPU time from /proc over `--seconds`, and stops it. Variants are environment settings for the
`pulse serve` process (`default`: none), run in the protocol's rotated order, so an A/B of a setting shares the
box's slices of time:

    python -m bench.idle_cpu --variants default RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1 --repeats 3 --warmup 0

The table: total % of a core, the resident memory of every process `pulse serve` started (MiB, Ray's
included), how many processes and how many of them are Ray's idle workers (`ray::IDLE`), the processes
that hold the most memory (`rss:`, MiB; the driver is `pulse serve` itself) and those that take most of the
CPU (Ray's workers by their title: ServeController, the gateway replica, the worker actor; Ray's daemons by
name).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench import protocol
from bench.machine import checked_machine_info
from bench.procs import Proc, cpu_ticks, free_port, owned_processes, rss_mib, title

OUT_DIR = Path(__file__).resolve().parent / "results"


def variant_env(variant: str) -> dict[str, str]:
    """`default` -> {}; `A=1,B=2` -> {"A": "1", "B": "2"}."""
    if variant == "default":
        return {}
    env = {}
    for part in variant.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"variant {variant!r}: expected NAME=VALUE[,NAME=VALUE] or 'default'")
        env[key] = value
    return env


def per_process_pct(before: dict, after: dict, seconds: float, titles: dict[int, str]) -> dict[str, float]:
    """% of one core per process title over `seconds`, from two cpu_ticks readings (pids in both)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, (name, ticks) in after.items():
        if pid in before:
            key = titles.get(pid, name)
            out[key] = out.get(key, 0.0) + (ticks - before[pid][1]) / tick / seconds * 100
    return out


async def measure_once(args, env: dict[str, str], log_dir: Path, procs: list) -> dict:
    """One reading; `procs` (owned_processes') holds the server while it runs, so that a SIGTERM to the bench
    (a time limit) stops it too: it runs in a session of its own, which a kill of the bench's group misses."""
    port = free_port()
    argv = [sys.executable, "-m", "pulse.cli", "serve", "--backend", args.backend, "--host", "127.0.0.1",
            "--port", str(port), *(["--config", args.config] if args.config else [])]
    proc = Proc(f"pulse-{port}", argv, log_dir, env=env)
    procs.append(proc)
    try:
        await asyncio.to_thread(proc.wait_healthy, f"http://127.0.0.1:{port}/health", args.start_timeout)
        await asyncio.sleep(args.settle)
        pids = proc.tree()
        # Ray's workers by their title (ray::ServeController ...), its daemons and the rest by /proc's name
        titles = {pid: t.split(" ")[0] for pid in pids if (t := title(pid)).startswith("ray::")}
        before = cpu_ticks(pids)
        await asyncio.sleep(args.seconds)
        after = cpu_ticks(pids)
        by = per_process_pct(before, after, args.seconds, titles)
        rss = {pid: sum(rss_mib([pid]).values()) for pid in after}
    finally:
        await asyncio.to_thread(proc.stop)
        procs.remove(proc)
    rss_by: dict[str, float] = {}
    for pid, mib in rss.items():
        key = titles.get(pid, "pulse serve (driver)" if pid == proc.popen.pid else after[pid][0])
        rss_by[key] = rss_by.get(key, 0.0) + mib
    metrics = {"total_pct_core": sum(by.values()), "rss_mib": sum(rss.values()), "processes": len(after),
               "ray_idle_workers": sum(t == "ray::IDLE" for pid, t in titles.items() if pid in after)}
    metrics.update({f"pct:{k}": v for k, v in by.items()})
    metrics.update({f"rss:{k}": v for k, v in rss_by.items()})
    return {"metrics": metrics}


def largest(summary: dict, prefix: str, n: int) -> list[str]:
    """The `n` metrics named `prefix...` with the largest median in any variant, largest first."""
    best: dict[str, float] = {}
    for s in summary.values():
        for k, v in s.items():
            if k.startswith(prefix):
                best[k] = max(best.get(k, 0.0), v["median"])
    return sorted(best, key=lambda k: -best[k])[:n]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["default"], help="`default` or NAME=VALUE[,NAME=VALUE]")
    ap.add_argument("--backend", default="loadtest")
    ap.add_argument("--config", help="a pulse config file for every variant")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long each reading lasts")
    ap.add_argument("--settle", type=float, default=10.0, help="wait after healthy before reading")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--top", type=int, default=8, help="processes shown in the table by their CPU")
    ap.add_argument("--rss-top", type=int, default=4, help="processes shown in the table by their resident memory")
    protocol.add_arguments(ap, OUT_DIR)
    args = ap.parse_args(argv)
    envs = {v: variant_env(v) for v in args.variants}
    machine = checked_machine_info()
    started = time.time()
    log_dir = Path(tempfile.mkdtemp(prefix="pulse-idle-"))
    with owned_processes() as procs:
        measures = {v: (lambda env=env: measure_once(args, env, log_dir, procs)) for v, env in envs.items()}
        # SIGINT (a device call's time limit, `timeout --signal=INT`) ends the runs; the ones that ended are published
        records, cut = protocol.run_to_limit(measures, args.repeats, args.warmup, not args.quiet, "asyncio")
    summary = protocol.summarize(records)
    top = largest(summary, "pct:", args.top) + largest(summary, "rss:", args.rss_top)
    verdict = [f"{v}: {summary[v]['total_pct_core']['median']:.2f}% of a core idle (median of "
               f"{summary[v]['total_pct_core']['n']})" for v in args.variants if v in summary] + ([cut] if cut else [])
    protocol.publish("idle_cpu", records, summary, vars(args) | {"out": str(args.out)}, started, machine, verdict,
                     ["total_pct_core", "rss_mib", "processes", "ray_idle_workers", *top], ["total_pct_core"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
