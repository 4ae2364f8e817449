"""What llama-server's own log says about each request: how it picked the slot, how long the pick took to
launch, and its prompt and decode times.

A llama-server started with `--log-timestamps` prefixes each line with minutes.seconds.milliseconds.microseconds
since it started. Between a request's `selected slot by ...` line and its `launch_slot_` line the server's one
loop thread may save what the slot held into its RAM prompt cache (`--cache-ram`): llama.cpp does so when it picked
the slot by LRU or by prompt similarity keeping less than half of the slot's tokens (`f_keep` < 0.5). On the H200
such a launch took ~45 ms, and every slot waits meanwhile; a launch without a save takes microseconds. So the
launch wait per way of picking says what the prompt cache costs under a load.

    python -m bench.llama_server_log LOG [LOG ...]       # the parity bench's logs-parity-*/llama-server-*.log
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_TS = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")
_PICK = re.compile(r"get_availabl: id\s+(\d+) \| task -?\d+ \| selected slot by (id|LCP similarity|LRU)"
                   r"(?:.*f_keep = ([\d.]+))?")
_LAUNCH = re.compile(r"launch_slot_: id\s+(\d+) \| task (\d+)")
_PROMPT = re.compile(r"id\s+\d+ \| task (\d+) \| prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")
# with -lv 4: each time the context re-reserves its compute graphs (llama.cpp's sched_reserve; with
# --backend-sampling at every request's start and end) and how long that took inside the call
_RESERVE = re.compile(r"sched_reserve: reserve took ([\d.]+) ms")
_EVAL = re.compile(r"id\s+\d+ \| task (\d+) \|\s+eval time =\s+([\d.]+) ms /\s+(\d+) tokens")
PICKS = {"id": "id", "LCP similarity": "similarity", "LRU": "lru"}


@dataclass
class Launch:
    task: int
    slot: int
    pick: str  # id (the caller named the slot), similarity, lru
    f_keep: float | None  # llama.cpp's share of the slot's tokens the prompt keeps (similarity picks only)
    wait_ms: float  # from the pick to the launch: the RAM prompt cache's save, when there is one
    prompt_ms: float | None = None
    prompt_tokens: int | None = None
    ms_per_token: float | None = None
    at: float = 0.0  # seconds since the server started, at the launch


def _seconds(line: str) -> float | None:
    m = _TS.match(line)
    return None if m is None else int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6


def parse(lines: Iterable[str]) -> list[Launch]:
    """Every launched request of a `--log-timestamps` log, in launch order. A pick whose request was deferred
    (its slot busy) is replaced by the pick made when it is retried."""
    picked: dict[int, tuple[float, str, float | None]] = {}
    launches: dict[int, Launch] = {}
    for line in lines:
        if (t := _seconds(line)) is None:
            continue
        if m := _PICK.search(line):
            picked[int(m[1])] = (t, PICKS[m[2]], float(m[3]) if m[3] else None)
        elif m := _LAUNCH.search(line):
            slot, task = int(m[1]), int(m[2])
            if (p := picked.pop(slot, None)) is not None:
                launches[task] = Launch(task, slot, p[1], p[2], (t - p[0]) * 1e3, at=t)
        elif (m := _PROMPT.search(line)) and (launch := launches.get(int(m[1]))):
            launch.prompt_ms, launch.prompt_tokens = float(m[2]), int(m[3])
        elif (m := _EVAL.search(line)) and (launch := launches.get(int(m[1]))) and int(m[3]):
            launch.ms_per_token = float(m[2]) / int(m[3])
    return list(launches.values())


def deferred_picks(lines: Iterable[str]) -> int:
    """How many slot picks were not launched: the request named a slot that was busy, so llama-server deferred
    it until that very slot ends its generation (and retried the pick then), where a request naming no slot takes
    whichever frees first. A deferred pick is followed by another pick before any launch."""
    deferred, waiting = 0, False
    for line in lines:
        if _PICK.search(line):
            deferred += waiting
            waiting = True
        elif _LAUNCH.search(line):
            waiting = False
    return deferred + waiting


def launch_groups(launches: Sequence[Launch], within_s: float = 0.001) -> list[int]:
    """Sizes of the groups the launches came in: a launch within `within_s` of the one before joins its group.
    The server launches what waits in its queue between two steps all at once, so a group is the requests that
    reached it during one step, and each group's first step carries their prompts (on the H100 with the h200
    profile's flags such a step took 70-230 ms for 5-token prompts, where a decode step took 1.3-3.8 ms). Closed-loop
    clients that re-arrive within one step's gap share one launch step; arrivals spread a few ms wider take more."""
    sizes: list[int] = []
    last = None
    for at in sorted(launch.at for launch in launches):
        if last is not None and at - last < within_s:
            sizes[-1] += 1
        else:
            sizes.append(1)
        last = at
    return sizes


def slice_metrics(path: Path, start: int, end: int) -> dict[str, float]:
    """For the part of a log between byte offsets `start` and `end` (one run): its launches, the launch groups they
    came in (launch_groups), the mean group size and the server's own prompt eval p50 (launch to first token)."""
    with path.open("rb") as fh:
        fh.seek(start)
        text = fh.read(max(0, end - start)).decode(errors="replace")
    rows = text.splitlines()
    launches = parse(rows)
    if not launches:
        return {}
    groups = launch_groups(launches)
    out = {"server_launches": len(launches), "launch_groups": len(groups),
           "launches_per_group": len(launches) / len(groups), "deferred_picks": deferred_picks(rows),
           "server_prompt_p50_ms": _q([launch.prompt_ms for launch in launches], 0.5)}
    reserves = [float(m.group(1)) for m in _RESERVE.finditer(text)]
    if reserves:  # only a server started with -lv 4 logs them
        out |= {"server_reserves": len(reserves), "server_reserve_ms": sum(reserves)}
    return out


def parse_file(path: Path) -> list[Launch]:
    with path.open(errors="replace") as fh:
        return parse(fh)


def _q(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summarize(launches: Sequence[Launch]) -> dict[str, dict]:
    """Per way of picking: count, launch wait p50/p90/max and total, prompt eval ms p50, decode ms per token p50."""
    out = {}
    for pick in sorted({launch.pick for launch in launches}):
        ls = [launch for launch in launches if launch.pick == pick]
        waits = [launch.wait_ms for launch in ls]
        out[pick] = {"n": len(ls), "wait_p50_ms": _q(waits, 0.5), "wait_p90_ms": _q(waits, 0.9),
                     "wait_max_ms": max(waits), "wait_total_s": sum(waits) / 1e3,
                     "prompt_p50_ms": _q([launch.prompt_ms for launch in ls], 0.5),
                     "ms_per_token_p50": _q([launch.ms_per_token for launch in ls], 0.5)}
    return out


def lines(summary: dict[str, dict]) -> list[str]:
    def f(v):
        return "-" if v is None else f"{v:.2f}"
    return [f"llama-server launches picked by {pick}: {s['n']}, launch wait p50 {f(s['wait_p50_ms'])} ms, "
            f"p90 {f(s['wait_p90_ms'])}, max {f(s['wait_max_ms'])}, total {s['wait_total_s']:.1f} s; prompt eval "
            f"p50 {f(s['prompt_p50_ms'])} ms; decode p50 {f(s['ms_per_token_p50'])} ms/token"
            for pick, s in summary.items()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_server_log", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    for path in args.logs:
        launches = parse_file(path)
        print(f"{path}: {len(launches)} launches")
        for line in lines(summarize(launches)):
            print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
