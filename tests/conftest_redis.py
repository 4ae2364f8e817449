"""A real redis-server for tests, on a free loopback port, without persistence.

Use from a conftest or a test module:

    from tests.conftest_redis import redis_server  # noqa: F401  (the fixture)

    async def test_x(redis_server):
        url = redis_server.url
        redis_server.stop()      # Redis down (connections refused)
        redis_server.start()     # back on the same port, empty (no persistence)
        redis_server.pause()     # SIGSTOP: Redis "slow" (accepts nothing, answers nothing)
        redis_server.resume()    # SIGCONT

The fixture skips the test when no redis-server binary is installed, and always stops the server.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str, port: int | None = None):
        self.binary = binary
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="pulse-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (or restart) on the same port and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not self._answers_ping():
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop it and wait; connections are refused until start()."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.resume()  # a stopped process cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): calls hang, as with a Redis that is overloaded or unreachable."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


def redis_binary() -> str:
    """redis-server's path; a skip where it is missing, a failure under CI (deploy/install.sh installs it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: deploy/install.sh should have installed it")
        pytest.skip("redis-server is not installed")
    return binary


def _serve():
    server = RedisServer(redis_binary())
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_server():
    """A fresh, empty redis-server per test (it starts in a few milliseconds)."""
    yield from _serve()


@pytest.fixture(scope="module")
def redis_module():
    """One redis-server for a module whose tests share a `pulse serve` pointed at it."""
    yield from _serve()
