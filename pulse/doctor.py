"""`pulse doctor`: check the machine before a benchmark and say what would spoil the figures.

Readings (impure, best effort: a reading that cannot be taken is None and is reported as unknown) are
turned into findings by pure functions, one per check, so the thresholds are tested on tables of readings.
Exit code 0: nothing found; 1: at least one warning.

Why these checks: another GPU process takes SMs and memory bandwidth; load and CPU-hungry neighbours steal
the cores a 2-core box's gateway and load generator share; memory pressure and swap add stalls (on GB10's
unified memory, CPU memory traffic alone cost ~16% of decode); a power-saving governor ramps clocks late.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOAD_PER_CORE = 0.3  # 1-min load per core above this: something else is running
MEM_AVAILABLE_FRACTION = 0.15  # less available than this: page cache and allocator will fight the benchmark
PSI_SOME_AVG10 = 1.0  # % of the last 10 s some task stalled on memory
SWAP_USED_MIB = 256
HEAVY_PROCESS_CPU = 20.0  # % of one core


@dataclass
class GpuProcess:
    pid: int
    name: str
    used_mib: float


@dataclass
class Proc:
    pid: int
    name: str
    cpu_percent: float  # of one core, over the sampling window
    cmd: str = ""  # command line, shortened: says which python is which


@dataclass
class Readings:
    cores: int
    loadavg: tuple[float, float, float] | None = None
    mem_total_kib: int | None = None
    mem_available_kib: int | None = None
    swap_total_kib: int | None = None
    swap_free_kib: int | None = None
    psi_memory_some_avg10: float | None = None
    psi_memory_full_avg10: float | None = None
    governors: list[str] | None = None  # one per CPU where cpufreq is exposed
    gpu_processes: list[GpuProcess] | None = None  # None: no nvidia-smi
    top_processes: list[Proc] = field(default_factory=list)


@dataclass
class Finding:
    check: str
    ok: bool | None  # None: could not read
    value: str
    note: str = ""


# ---- pure: readings -> findings ----

def check_gpu(r: Readings) -> Finding:
    if r.gpu_processes is None:
        return Finding("gpu processes", None, "no nvidia-smi", "no NVIDIA GPU to check")
    if not r.gpu_processes:
        return Finding("gpu processes", True, "none")
    names = ", ".join(f"{p.name}[{p.pid}] {p.used_mib:.0f} MiB" for p in r.gpu_processes)
    return Finding("gpu processes", False, names, "another process holds the GPU: its kernels and memory traffic "
                   "share the SMs")


def check_load(r: Readings) -> Finding:
    if r.loadavg is None:
        return Finding("load average", None, "unreadable")
    one, five, _ = r.loadavg
    value = f"{one:.2f} / {five:.2f} on {r.cores} cores"
    if one > LOAD_PER_CORE * r.cores:
        return Finding("load average", False, value, f"1-min load above {LOAD_PER_CORE:g} per core: "
                       "something else is using the CPUs")
    return Finding("load average", True, value)


def check_memory(r: Readings) -> Finding:
    if not r.mem_total_kib or r.mem_available_kib is None:
        return Finding("memory available", None, "unreadable")
    frac = r.mem_available_kib / r.mem_total_kib
    value = f"{r.mem_available_kib / 2**20:.1f} of {r.mem_total_kib / 2**20:.1f} GiB ({frac:.0%})"
    if frac < MEM_AVAILABLE_FRACTION:
        return Finding("memory available", False, value, f"below {MEM_AVAILABLE_FRACTION:.0%} available")
    return Finding("memory available", True, value)


def check_pressure(r: Readings) -> Finding:
    if r.psi_memory_some_avg10 is None:
        return Finding("memory pressure", None, "no /proc/pressure/memory")
    value = f"some {r.psi_memory_some_avg10:.2f}% full {r.psi_memory_full_avg10 or 0:.2f}% (avg10)"
    if r.psi_memory_some_avg10 > PSI_SOME_AVG10:
        return Finding("memory pressure", False, value, "tasks are stalling on memory right now")
    return Finding("memory pressure", True, value)


def check_swap(r: Readings) -> Finding:
    if r.swap_total_kib is None or r.swap_free_kib is None:
        return Finding("swap", None, "unreadable")
    if r.swap_total_kib == 0:
        return Finding("swap", True, "no swap")
    used = (r.swap_total_kib - r.swap_free_kib) / 1024
    value = f"{used:.0f} MiB used of {r.swap_total_kib / 1024:.0f}"
    if used > SWAP_USED_MIB:
        return Finding("swap", False, value, "pages in swap can fault in during the run")
    return Finding("swap", True, value)


def check_governor(r: Readings) -> Finding:
    if not r.governors:
        return Finding("cpu governor", None, "not exposed", "no cpufreq here (VM or container)")
    kinds = sorted(set(r.governors))
    value = ",".join(kinds)
    if kinds != ["performance"]:
        return Finding("cpu governor", False, value, "not 'performance': clocks ramp up during the run")
    return Finding("cpu governor", True, value)


def check_processes(r: Readings) -> Finding:
    heavy = [p for p in r.top_processes if p.cpu_percent >= HEAVY_PROCESS_CPU]
    if not heavy:
        return Finding("busy processes", True, "none above %g%% of a core" % HEAVY_PROCESS_CPU)
    value = ", ".join(f"{p.cmd or p.name}[{p.pid}] {p.cpu_percent:.0f}%" for p in heavy[:5])
    return Finding("busy processes", False, value, "they compete with the benchmark for the CPUs")


CHECKS = (check_gpu, check_load, check_memory, check_pressure, check_swap, check_governor, check_processes)


def findings(r: Readings) -> list[Finding]:
    return [check(r) for check in CHECKS]


def table(found: Sequence[Finding]) -> str:
    mark = {True: "ok", False: "WARN", None: "unknown"}
    rows = [("check", "status", "value", "note")] + [(f.check, mark[f.ok], f.value, f.note) for f in found]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3] for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def exit_code(found: Sequence[Finding]) -> int:
    return 1 if any(f.ok is False for f in found) else 0


# ---- parsing of /proc text (pure) ----

def parse_meminfo(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0])
    return out


def parse_psi(text: str) -> dict[str, float]:
    """{'some': avg10, 'full': avg10} from /proc/pressure/* text."""
    out = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        for f in fields:
            k, _, v = f.partition("=")
            if k == "avg10":
                out[kind] = float(v)
    return out


def parse_gpu_apps(csv: str) -> list[GpuProcess]:
    """nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits output."""
    procs = []
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            used = float(parts[2]) if parts[2].replace(".", "", 1).isdigit() else 0.0
            procs.append(GpuProcess(int(parts[0]), parts[1], used))
    return procs


def cpu_percent(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], seconds: float,
                hz: int, exclude: set[int] = frozenset()) -> list[Proc]:
    """Per-process % of one core between two {pid: (name, utime+stime ticks)} samples, busiest first."""
    procs = []
    for pid, (name, ticks) in after.items():
        if pid in exclude or pid not in before:
            continue
        pct = 100.0 * (ticks - before[pid][1]) / hz / seconds
        procs.append(Proc(pid, name, pct))
    return sorted(procs, key=lambda p: -p.cpu_percent)


# ---- impure: take the readings ----

def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _read(f"/proc/{entry.name}/stat")):
            name = stat[stat.find("(") + 1: stat.rfind(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out[int(entry.name)] = (name, int(fields[11]) + int(fields[12]))  # utime + stime
    return out


def _ancestors(pid: int) -> set[int]:
    """This process and its parents: the shell that runs `pulse doctor` is not a neighbour."""
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        stat = _read(f"/proc/{pid}/stat")
        pid = int(stat.rsplit(")", 1)[1].split()[1]) if stat else 0
    return out


def _gpu_processes() -> list[GpuProcess] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_apps(out.stdout) if out.returncode == 0 else None


def _governors() -> list[str] | None:
    govs = [g.strip() for p in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor"))
            if (g := _read(str(p)))]
    return govs or None


def take_readings(sample_s: float = 1.0) -> Readings:
    before, t0 = _cpu_ticks(), time.monotonic()
    time.sleep(sample_s)  # CPU use is a rate: it needs two samples
    after, t1 = _cpu_ticks(), time.monotonic()
    mem = parse_meminfo(_read("/proc/meminfo") or "")
    psi = parse_psi(_read("/proc/pressure/memory") or "")
    hz = os.sysconf("SC_CLK_TCK")
    return Readings(
        cores=os.cpu_count() or 1,
        loadavg=os.getloadavg(),
        mem_total_kib=mem.get("MemTotal"),
        mem_available_kib=mem.get("MemAvailable"),
        swap_total_kib=mem.get("SwapTotal"),
        swap_free_kib=mem.get("SwapFree"),
        psi_memory_some_avg10=psi.get("some"),
        psi_memory_full_avg10=psi.get("full"),
        governors=_governors(),
        gpu_processes=_gpu_processes(),
        top_processes=[_with_cmd(p) for p in cpu_percent(before, after, t1 - t0, hz,
                                                        exclude=_ancestors(os.getpid()))[:10]],
    )


def _with_cmd(p: Proc, width: int = 48) -> Proc:
    raw = _read(f"/proc/{p.pid}/cmdline") or ""
    args = [a for a in raw.split("\0") if a]
    if args:
        args[0] = os.path.basename(args[0])
        p.cmd = " ".join(args)[:width]
    return p


def doctor_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pulse doctor", description="Check this machine before a benchmark.")
    ap.add_argument("--sample", type=float, default=1.0, help="seconds to sample per-process CPU use")
    ap.add_argument("--json", action="store_true", help="print readings and findings as JSON")
    args = ap.parse_args(argv)
    readings = take_readings(args.sample)
    found = findings(readings)
    if args.json:
        print(json.dumps({"readings": asdict(readings), "findings": [asdict(f) for f in found]}, indent=1))
    else:
        print(table(found))
        bad = sum(f.ok is False for f in found)
        print(f"\n{bad} warning(s): figures taken now may be spoiled" if bad else "\nclean: fit to measure")
    return exit_code(found)


if __name__ == "__main__":
    sys.exit(doctor_main(sys.argv[1:]))
