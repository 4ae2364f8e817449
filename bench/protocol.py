"""The measurement protocol from DEVICE_FACTS.md, in code.

What held on the GB10 and Thor boxes: discard warm-up runs (first runs after start are slow), interleave the
configurations inside every repeat (so drift, thermal state and neighbours hit all of them alike), reverse and
rotate the order between repeats (so no configuration always runs first, or always after the same one), take
>= 5 repeats, report median and min/max.

`schedule` and `summarize` are pure and unit-tested; `run` drives async measurement callables through the
schedule; `write_result` stores JSON (with the command line and machine), a Markdown table and a PNG plot.
"""
from __future__ import annotations

import json
import numbers
import os
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import loops
from bench.machine import describe, machine_info

MIN_REPEATS = 5

Metrics = dict[str, float]
Measure = Callable[[], Awaitable[dict[str, Any]]]  # Metrics, or {"metrics": Metrics, ...}


@dataclass(frozen=True)
class Step:
    """One measurement run: `phase` is "warmup" (discarded) or "measure"; `repeat` counts within the phase."""

    phase: str
    repeat: int
    config: str


def schedule(configs: Sequence[str], repeats: int, warmup: int) -> list[Step]:
    """Every repeat runs every configuration once, ABAB..., the order reversed every other repeat and rotated by
    one every two (ABC, CBA, BCA, ACB, CAB, BAC: over six repeats each configuration runs once in every place, and
    from the second on any two neighbours have run both ways round). Reversal matters where the configurations
    are cells of targets (served.py's `pulse/story/greedy/c256`, `pulse-qgc/story/greedy/c256`, ...): a rotation
    by one alone keeps each cell's targets in the same order every repeat, and on the H200 the later runs of a
    cell came out faster (2026-12-04, BENCHMARKS.md). The warm-up repeats follow the same pattern from its start."""
    if not configs:
        raise ValueError("no configurations to measure")
    if len(set(configs)) != len(configs):
        raise ValueError(f"duplicate configuration names: {list(configs)}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    steps = []
    for phase, count in (("warmup", warmup), ("measure", repeats)):
        for r in range(count):
            shift = (r // 2) % len(configs)
            order = [*configs[shift:], *configs[:shift]]
            steps += [Step(phase, r, name) for name in (order[::-1] if r % 2 else order)]
    return steps


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and min/max of one metric over the repeats (NaN-free input expected)."""
    if not values:
        raise ValueError("no values")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{config: {metric: spread}} over the measured records; warm-up records are ignored here, by design."""
    grouped: dict[str, dict[str, list[float]]] = {}
    for rec in records:
        if rec["phase"] != "measure":
            continue
        metrics = grouped.setdefault(rec["config"], {})
        for name, value in _flat(rec["metrics"]):
            metrics.setdefault(name, []).append(value)
    return {cfg: {m: spread(v) for m, v in ms.items()} for cfg, ms in grouped.items()}


def _flat(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """A run's numeric metrics; a nested mapping (bench/served.py's step-thread `phases`, the attention kernel's
    variant) as `name.key`, anything else that is not a number (None, text) left out."""
    for name, value in metrics.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{name}.")
        elif isinstance(value, numbers.Real):  # NumPy's scalars too, as float() took them before
            yield f"{prefix}{name}", float(value)


def by_repeat(records: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Metrics]]:
    """{repeat: {config: metrics}} of the measured records: lets a benchmark pair configurations per repeat."""
    out: dict[int, dict[str, Metrics]] = {}
    for rec in records:
        if rec["phase"] == "measure":
            out.setdefault(rec["repeat"], {})[rec["config"]] = dict(rec["metrics"])
    return out


async def run(
    measures: Mapping[str, Measure], repeats: int = MIN_REPEATS, warmup: int = 2, progress: bool = True,
    records: list | None = None,
) -> list[dict[str, Any]]:
    """Run the schedule; returns every record, warm-up included (marked), in the order run. `records`: the list
    to append them to as each run ends, so that a caller whose run is cut short (a device call's time limit)
    still has the finished ones."""
    if repeats < MIN_REPEATS:
        print(f"warning: {repeats} repeats is below the protocol's {MIN_REPEATS}", file=sys.stderr)
    steps = schedule(list(measures), repeats, warmup)
    records = [] if records is None else records
    bar = _progress(len(steps), progress)
    for step in steps:
        bar.set_description(f"{step.phase} {step.repeat + 1} {step.config}")
        started = time.time()
        out = dict(await measures[step.config]())
        # a measure returns flat metrics, or {"metrics": {...}, ...detail kept beside them}
        metrics = out.pop("metrics") if "metrics" in out else out
        detail = out if metrics is not out else {}
        records.append(
            {"phase": step.phase, "repeat": step.repeat, "config": step.config, "started": started,
             "seconds": time.time() - started, "metrics": metrics, **({"detail": detail} if detail else {})}
        )
        bar.update(1)
    bar.close()
    return records


def run_to_limit(measures: Mapping[str, Measure], repeats: int, warmup: int, progress: bool, loop: str
                 ) -> tuple[list[dict[str, Any]], str | None]:
    """`run` on event loop `loop` (bench.loops), cut short by SIGINT (a device script's time limit): the records of
    the runs that ended, and None or the line saying how many ran. SIGINT is ignored from then on: one arriving
    while the caller stops its servers would lose the summary of every run."""
    records: list[dict[str, Any]] = []
    try:
        loops.run(run(measures, repeats, warmup, progress, records), loop)
        interrupted = None
    except KeyboardInterrupt:
        interrupted = f"interrupted after {len(records)} of {len(measures) * (repeats + warmup)} runs"
        print(interrupted, file=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return records, interrupted


def add_arguments(ap, out_dir: Path) -> None:
    """The protocol's knobs, the same in every benchmark's command line."""
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"measured repeats (>= {MIN_REPEATS})")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up repeats, discarded")
    ap.add_argument("--out", type=Path, default=out_dir, help="where JSON, table and plot go")
    ap.add_argument("--quiet", action="store_true", help="no progress line")


def _progress(total: int, enabled: bool):
    # tqdm draws a status line on stderr; disabled it is a no-op with the same methods
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU machine's Python has no tqdm: no status line there
        return _NoBar()
    return tqdm(total=total, disable=not enabled, file=sys.stderr, leave=False)


class _NoBar:
    def set_description(self, _: str) -> None: ...
    def update(self, _: int) -> None: ...
    def close(self) -> None: ...


def markdown_table(
    summary: Mapping[str, Mapping[str, Mapping[str, float]]], metrics: Sequence[str], digits: int = 2
) -> str:
    """One row per configuration, one column per metric as `median (min–max)`."""
    head = "| config | " + " | ".join(metrics) + " |"
    rule = "| --- |" + " --- |" * len(metrics)
    rows = []
    for cfg, ms in summary.items():
        cells = [_cell(ms.get(m), digits) for m in metrics]
        rows.append(f"| {cfg} | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])


def _cell(s: Mapping[str, float] | None, digits: int) -> str:
    if s is None:
        return "–"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def plot(summary: Mapping[str, Mapping[str, Mapping[str, float]]], metrics: Sequence[str], path: Path,
         title: str = "") -> Path:
    """One bar panel per metric: median bars with min/max whiskers."""
    import matplotlib

    matplotlib.use("Agg")  # no display on benchmark boxes
    import matplotlib.pyplot as plt

    configs = list(summary)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        rows = [(c, summary[c][metric]) for c in configs if metric in summary[c]]
        med = [s["median"] for _, s in rows]
        err = [[s["median"] - s["min"] for _, s in rows], [s["max"] - s["median"] for _, s in rows]]
        ax.bar(range(len(rows)), med, yerr=err, capsize=4, color="#4c72b0")
        ax.set_xticks(range(len(rows)), [c for c, _ in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(metric, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def result_document(name: str, records: list[dict[str, Any]], summary: Mapping[str, Any],
                    params: Mapping[str, Any], started: float, machine: Mapping[str, Any] | None = None,
                    ) -> dict[str, Any]:
    """The JSON shape every benchmark writes: what ran, where, when, every raw record and the summary.

    Pass `machine` as read before the run (its load average is the one that matters); the load at the end
    is added beside it.
    """
    return {
        "benchmark": name,
        "command": command_line(),
        "machine": dict(machine or machine_info()),
        "loadavg_end": list(os.getloadavg()),
        "params": dict(params),
        "started": started,
        "finished": time.time(),
        "protocol": {"repeats": _count(records, "measure"), "warmup": _count(records, "warmup"),
                     "order": [f"{r['phase']}:{r['config']}" for r in records]},
        "records": records,
        "summary": summary,
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as someone would retype it: `python -m bench.x ...` for our modules run with -m."""
    argv = list(sys.argv if argv is None else argv)
    first = Path(argv[0]) if argv else Path("python")
    if first.suffix == ".py" and first.parent.name == "bench":
        head = ["python", "-m", f"bench.{first.stem}"]
    else:
        head = [first.name]
    return shlex.join([*head, *argv[1:]])


def _count(records: Sequence[Mapping[str, Any]], phase: str) -> int:
    return len({r["repeat"] for r in records if r["phase"] == phase})


def write_result(doc: Mapping[str, Any], table: str, metrics: Sequence[str], out_dir: Path,
                 notes: str = "") -> dict[str, Path]:
    """Write <name>-<utc stamp>.json/.md/.png under out_dir; returns their paths.

    The .md holds what BENCHMARKS.md needs: the command, the machine, the table, and `notes` (e.g. a verdict).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(doc["finished"]))
    base = out_dir / f"{doc['benchmark']}-{stamp}"
    paths = {"json": base.with_suffix(".json"), "md": base.with_suffix(".md"), "png": base.with_suffix(".png")}
    paths["json"].write_text(json.dumps(doc, indent=1, default=str))
    paths["md"].write_text(f"`{doc['command']}`\n\nMachine: {describe(doc['machine'])}\n\n{table}\n"
                           + (f"\n{notes}\n" if notes else ""))
    plot(doc["summary"], metrics, paths["png"], title=doc["benchmark"])
    return paths


def publish(name: str, records, summary: dict, params: dict, started: float, machine: dict, verdict: list[str],
            table_metrics: Sequence[str], plot_metrics: Sequence[str], out_dir: Path) -> dict:
    """A run's result document with its verdict lines, written (write_result) and printed; returns it."""
    doc = result_document(name, records, summary, params, started, machine)
    doc["verdict"] = verdict
    table = markdown_table(summary, table_metrics)
    paths = write_result(doc, table, plot_metrics, out_dir, notes="\n".join(verdict))
    print(f"\n`{doc['command']}`\n\nMachine: {describe(machine)}\n\n{table}\n")
    print("\n".join(verdict))
    print("\n" + "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return doc
