"""Shared fixtures: free ports, and a real `pulse serve` process (real Ray, real gateway, real workers)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free port outside the ephemeral range, which Ray's own components may take first (bench/faults.py)."""
    from bench.procs import free_port as quiet_port

    return quiet_port()


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


class PulseProcess:
    """`pulse serve` in a subprocess; stop() sends SIGTERM and waits for every process it started to go."""

    def __init__(self, args: list[str], config_yaml: str | None, tmp: Path, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pulse.cli", "serve", "--port", str(self.port), *args]
        if config_yaml is not None:
            cfg = tmp / f"pulse-{self.port}.yaml"
            cfg.write_text(config_yaml)
            cmd += ["--config", str(cfg)]
        self.log_path = tmp / f"pulse-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout_s: float = 240) -> "PulseProcess":
        try:
            wait_http(self.base + "/health", timeout_s, self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"pulse serve did not start:\n{self.log_path.read_text()[-4000:]}") from None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


LOADTEST_CONFIG = """
model: {name: gemma-3-270m}  # one model (a config naming none serves both bundled ones)
workers:
  backend: loadtest
  loadtest: {tokens: 100000, tokens_per_s: 400}
server:
  drain_grace_s: 5
"""


@pytest.fixture(scope="session")
def loadtest_server(tmp_path_factory):
    """One `pulse serve --backend loadtest` for the API tests: 400 tokens/s per stream, up to max_tokens."""
    srv = PulseProcess([], LOADTEST_CONFIG, tmp_path_factory.mktemp("pulse")).wait_ready()
    yield srv
    srv.stop()
