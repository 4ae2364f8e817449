"""One llama-server child process: start, wait for /health, supervise and restart, stop.

The process runs in its own session (process group) on a free loopback port. It cannot outlive the
worker: the kernel SIGKILLs it when the worker's thread that started it dies (PR_SET_PDEATHSIG), an
atexit hook kills what is left on a normal exit, and `stop()` sends SIGTERM, then SIGKILL after a grace.
When it dies unasked, the supervisor tells the backend at once (so in-flight streams end) and starts a
new one after an exponential backoff.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import aiohttp

log = logging.getLogger("pulse.llama_server")

_PR_SET_PDEATHSIG = 1
_LIVE: weakref.WeakSet[LlamaServerProcess] = weakref.WeakSet()


class ProcessStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@atexit.register
def _kill_leftovers() -> None:
    for p in list(_LIVE):
        p.kill_now()


class LlamaServerProcess:
    """Runs `argv_for(port)` and keeps it running until `stop()`.

    `on_exit(returncode)` is called (in the event loop) each time the process dies unasked, before the
    restart; `ready` is set while the process answers /health with 200.
    """

    def __init__(self, argv_for: Callable[[int], list[str]], *, name: str, log_path: Path,
                 startup_timeout_s: float = 180.0, backoff_max_s: float = 30.0, stop_grace_s: float = 5.0,
                 on_exit: Callable[[int], None] | None = None):
        self.argv_for, self.name, self.log_path = argv_for, name, log_path
        self.startup_timeout_s, self.backoff_max_s, self.stop_grace_s = startup_timeout_s, backoff_max_s, stop_grace_s
        self.on_exit = on_exit
        self.port = 0
        self.restarts = 0
        self.ready = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._started_at = 0.0
        self._stopping = False
        self._supervisor: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    async def start(self) -> None:
        """Launch and wait until /health says 200; raises ProcessStartError (with the log's tail) if not."""
        self._stopping = False
        await self._launch()
        self._supervisor = asyncio.create_task(self._supervise(), name=f"{self.name}-supervisor")

    async def _launch(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            self.port = free_port()
            try:
                await self._spawn_and_wait()
                return
            except ProcessStartError:
                # Another process may have taken the port between free_port() and the bind: try a new one.
                if attempt == attempts - 1 or self._stopping:
                    raise

    async def _spawn_and_wait(self) -> None:
        argv = self.argv_for(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists() and self.log_path.stat().st_size > 64 * 2**20:
            self.log_path.unlink()  # keep one bounded log per worker
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            logf.flush()
            # stdout to a file, not a pipe: a busy event loop must never block the server on a full pipe.
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))
        _LIVE.add(self)
        self._started_at = time.monotonic()
        log.info("%s: started pid %d on port %d", self.name, self._proc.pid, self.port)
        try:
            await self._wait_healthy()
        except BaseException:
            await self._kill_and_reap()
            raise
        self.ready.set()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if self._proc.returncode is not None:
                    raise ProcessStartError(
                        f"{self.name} exited with {self._proc.returncode} while starting:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise ProcessStartError(
                        f"{self.name} not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.05)

    async def _supervise(self) -> None:
        failures = 0
        while not self._stopping:
            rc = await self._proc.wait()
            if self._stopping:
                return
            self.ready.clear()
            self.restarts += 1
            uptime = time.monotonic() - self._started_at
            log.warning("%s: pid %d exited with %s after %.1f s; restarting\n%s",
                        self.name, self._proc.pid, rc, uptime, self.log_tail(10))
            if self.on_exit:
                self.on_exit(rc)
            if uptime > 60:
                failures = 0  # it ran fine for a while: this is a new failure, not a crash loop
            while not self._stopping:
                await asyncio.sleep(min(self.backoff_max_s, 0.25 * 2**failures))
                failures += 1
                try:
                    await self._launch()
                    break
                except ProcessStartError as e:
                    log.error("%s: restart failed: %s", self.name, e)

    def kill_now(self) -> None:
        """SIGKILL the whole process group (a hung process, or interpreter exit); the supervisor restarts it."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    async def _kill_and_reap(self) -> None:
        self.kill_now()
        if self._proc is not None:
            await self._proc.wait()

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace; returns when the process is gone. Safe to call twice."""
        self._stopping = True
        self.ready.clear()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) process cannot act on SIGTERM
        try:
            await asyncio.wait_for(proc.wait(), self.stop_grace_s)
        except asyncio.TimeoutError:
            log.warning("%s: pid %d ignored SIGTERM for %.1f s; SIGKILL", self.name, proc.pid, self.stop_grace_s)
            await self._kill_and_reap()
        _LIVE.discard(self)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""
