"""What a figure was measured on: CPU, cores, memory, GPU, load, git commit. Stored with every result."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_model(cpuinfo: str) -> str:
    """The CPU model name from /proc/cpuinfo text (x86 'model name', Arm 'Model'/'CPU part' fallbacks)."""
    for key in ("model name", "Model", "Hardware", "CPU part"):
        for line in cpuinfo.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return value.strip()
    return platform.processor() or platform.machine()


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def gpus() -> list[str]:
    """'name, memory' per GPU as nvidia-smi reports it; empty where there is no NVIDIA GPU."""
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines() if line.strip()]


def mem_total_gib() -> float | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def tree_commit(repo: Path = REPO) -> tuple[str | None, bool]:
    """(commit, dirty) of the tree the benches run from. A tree that is not its own git checkout (a `git archive`
    copy carried to the GPU machine inside another one: bench/gpu_clean_copy.sh) names its commit in a COMMIT
    file and is clean by construction; without one its commit is unknown, never the enclosing checkout's."""
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=repo)
    if not top or Path(top).resolve() != repo.resolve():
        stamp = repo / "COMMIT"
        return (stamp.read_text().strip() or None) if stamp.is_file() else None, False
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    return commit or None, bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo))


def machine_info() -> dict:
    commit, dirty = tree_commit()
    return {
        "cpu": cpu_model(_read("/proc/cpuinfo")),
        "cores": os.cpu_count(),
        "mem_total_gib": mem_total_gib(),
        "gpus": gpus(),
        "loadavg": list(os.getloadavg()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "hostname": platform.node(),
        "git_commit": commit or None,
        "git_dirty": dirty,
    }


def describe(info: dict) -> str:
    """One line for BENCHMARKS.md (missing readings show as '?')."""
    gpu = "; ".join(info.get("gpus") or []) or "no GPU"
    load = f"{info['loadavg'][0]:.2f}" if info.get("loadavg") else "?"
    return (f"{info.get('cpu', '?')}, {info.get('cores', '?')} cores, {info.get('mem_total_gib', '?')} GiB, {gpu}; "
            f"load {load} at start; commit {str(info.get('git_commit'))[:10]}"
            + (" (dirty)" if info.get("git_dirty") else "") + _doctor_note(info.get("doctor")))


def _doctor_note(found: list[dict] | None) -> str:
    if found is None:
        return ""
    warned = [f"{f['check']} ({f['value']})" for f in found if f["ok"] is False]
    return "; pulse doctor: " + ("; ".join(warned) if warned else "clean")


def checked_machine_info() -> dict:
    """machine_info() plus `pulse doctor`'s findings (what would spoil the figures), read before a benchmark
    starts anything, printed to stderr and kept with the result."""
    import sys
    from dataclasses import asdict

    from pulse import doctor

    found = doctor.findings(doctor.take_readings(0.5))
    print(doctor.table(found), file=sys.stderr)
    return machine_info() | {"doctor": [asdict(f) for f in found]}
