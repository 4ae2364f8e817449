"""Processes a benchmark starts: started in their own session, waited on until healthy, and all stopped.

A benchmark that leaves servers behind spoils the next measurement (and the box for everyone), so every
process is stopped in `finally` — SIGTERM to it, then SIGKILL to its group and to any descendant that moved
to another group (Ray's actors do), and what needed the SIGKILL is reported.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path


def free_port(low: int = 20000, high: int = 32767) -> int:
    """A free loopback port below the kernel's ephemeral range (32768+) and above Ray's worker ports.

    Not bind(0): that gives an ephemeral port, and Ray's components, started after we pick it and before
    the server binds it, take ephemeral ports too (seen here: the gateway failed with EADDRINUSE).
    """
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


def title(pid: int) -> str:
    """A process's first command-line word, where Ray names its workers (`ray::ServeController`; /proc's comm cuts
    names at 15 characters); "" when the process is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


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


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, start time in clock ticks since boot) from /proc/PID/stat; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the name may hold spaces or ')' itself: fields after the last ')' start at field 3 (state)
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.find("(") + 1: stat.rfind(")")], fields[0], int(fields[19])


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited and waiting for its parent to reap it, counts as gone)."""
    info = _stat(pid)
    return info is not None and info[1] != "Z"


def wait_gone(pid: int, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Whether `pid` is gone (exited; a zombie counts) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def start_time(pid: int) -> int | None:
    info = _stat(pid)
    return info[2] if info else None


def cpu_ticks(pids: list[int]) -> dict[int, tuple[str, int]]:
    """{pid: (name, utime + stime in clock ticks)} for the pids still running."""
    out = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[pid] = (stat[stat.find("(") + 1: stat.rfind(")")], int(fields[11]) + int(fields[12]))
    return out


def rss_mib(pids: list[int]) -> dict[str, float]:
    """Resident memory in MiB by process name, over the pids still running."""
    page = os.sysconf("SC_PAGE_SIZE") / 2**20
    out: dict[str, float] = {}
    for pid in pids:
        try:
            resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + resident * page
    return out


class Proc:
    """One started process with a log file; use as a context manager or call stop()."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict | None = None,
                 cwd: Path | None = None):
        self.name = name
        self.argv = list(argv)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      env={**os.environ, **(env or {})}, cwd=cwd)
        self._seen: set[tuple[int, int]] = set()  # (pid, start time): a reused pid is not ours
        self.leftovers: list[str] = []

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

    def tree(self) -> list[int]:
        """The main process and its live descendants: whose CPU time a request through it costs."""
        return [self.popen.pid, *descendants(self.popen.pid)]

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace: float = 15.0, settle: float = 5.0) -> list[str]:
        """Stop it as an operator would, then make sure: returns what had to be killed by force.

        SIGTERM goes to the main process only (as from Ctrl-C or a service manager), so its own shutdown
        path is what gets exercised; after `grace` for it and `settle` for its children, whatever of its
        group or of the descendants ever seen still lives gets SIGKILL and is named in the return value.
        """
        pid = self.popen.pid
        self._remember()
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + settle
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.leftovers = [f"{name}[{p}]" for p, name in self._alive()]
        _signal_group(pid, signal.SIGKILL)
        for child, _ in self._alive():
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.popen.poll() is None:
            self.popen.wait(timeout=5)
        deadline = time.monotonic() + 5  # SIGKILL is not instant: return only once they are gone
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._log.close()
        return self.leftovers

    def _alive(self) -> list[tuple[int, str]]:
        """(pid, name) of the main process and seen descendants still running (zombies are done)."""
        if self.popen.poll() is None:
            self._remember()
        out = []
        for child, started in self._seen | {(self.popen.pid, start_time(self.popen.pid))}:
            info = _stat(child)
            # a changed start time means the pid now names someone else's process
            if info and info[2] == started and info[1] != "Z":
                out.append((child, info[0]))
        return out

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


class Served:
    """A server started on a free port, in `procs` (stopped with them); `ready()` waits for its health.

    free_port() only finds a port free when asked: another process (Ray's components, a client's connection
    on a box whose ephemeral range is wider) can take it before the server binds it — CI saw the relay exit
    with EADDRINUSE. A server that exits saying its address is in use is started again on another port.
    """

    def __init__(self, procs: list, name: str, argv_for, log_dir: Path, env: dict | None = None,
                 health: str = "/health", tries: int = 3, cwd: Path | None = None):
        self.procs, self.name, self.argv_for, self.log_dir, self.env = procs, name, argv_for, log_dir, env
        self.health, self.tries, self.cwd = health, tries, cwd
        self.port = free_port()
        self.proc = Proc(name, argv_for(self.port), log_dir, env, cwd)
        procs.append(self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self, timeout: float) -> str:
        """The server's base URL once it answers its health check; RuntimeError as Proc.wait_healthy's."""
        for attempt in range(self.tries):
            try:
                self.proc.wait_healthy(self.url + self.health, timeout)
                return self.url
            except RuntimeError:
                if attempt + 1 == self.tries or not _lost_its_port(self.proc):
                    raise
            print(f"warning: {self.name} found port {self.port} taken; starting it on another", file=sys.stderr)
            self.proc.stop()
            self.proc.log_path.rename(self.proc.log_path.with_suffix(f".port-{self.port}-taken.log"))  # kept
            self.port = free_port()
            fresh = Proc(self.name, self.argv_for(self.port), self.log_dir, self.env, self.cwd)
            self.procs[self.procs.index(self.proc)] = fresh  # the same place: stopped in the same order
            self.proc = fresh
        raise AssertionError("unreachable")


def _lost_its_port(proc: Proc) -> bool:
    """Whether the process exited because its address was in use: Python's OSError (Errno 98), llama-server's
    "couldn't bind HTTP server socket"."""
    if proc.popen.poll() is None:
        return False
    tail = proc.log_tail(60).lower()
    return "address already in use" in tail or "couldn't bind http server socket" in tail


def stop_all(procs: list) -> None:
    """Stop what a benchmark started, last first, and say what any of them left behind (and was killed)."""
    for proc in reversed(procs):
        if leftovers := proc.stop():
            print(f"warning: {proc.name} left {', '.join(leftovers)} after SIGTERM (killed)", file=sys.stderr)


@contextmanager
def owned_processes():
    """The list a benchmark appends its processes to; all are stopped on the way out (stop_all), also on
    SIGTERM, which becomes SystemExit meanwhile so that this exit runs and no server outlives the benchmark."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs: list = []
    try:
        yield procs
    finally:
        stop_all(procs)
        signal.signal(signal.SIGTERM, previous)
