"""Processes a benchmark starts: started in their own session, waited on until healthy, and all stopped.

A benchmark that leaves servers behind spoils the next measurement (and the box for everyone), so every
process is stopped in `finally` — SIGTERM to its process group, then SIGKILL to the group and to any
descendant that moved to another group (Ray's helpers can).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid, read from /proc (children first found, breadth-first)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the command name may hold spaces or ')' itself: the ppid is the 2nd field after the last ')'
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class Proc:
    """One started process with a log file; use as a context manager or call stop()."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.argv = list(argv)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      env={**os.environ, **(env or {})})
        self._seen: set[tuple[int, int]] = set()  # (pid, start time): a reused pid is not ours

    def _remember(self) -> None:
        self._seen.update((p, t) for p in descendants(self.popen.pid) if (t := start_time(p)) is not None)

    def wait_healthy(self, url: str, timeout: float) -> None:
        """Poll url until it answers 200; raise RuntimeError (with the log's tail) on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._remember()
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy at {url} after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the group, wait up to grace, then SIGKILL the group and every descendant ever seen."""
        pid = self.popen.pid
        self._remember()
        if self.popen.poll() is None:
            _signal_group(pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(pid, signal.SIGKILL)
        self._remember()
        for child, started in self._seen:
            if start_time(child) != started:
                continue  # gone, or the pid now names someone else's process
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.popen.poll() is None:
            self.popen.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
