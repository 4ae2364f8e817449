"""Run a freshly built llama-server once: `--version`, then one generated token on a real GGUF.

    python3 deploy/check_llama_server.py BINARY [MODEL.gguf] [--cpu-only]

Exit status: 0 it ran; 3 it was killed by a signal (SIGILL from an instruction this CPU does not run,
SIGSEGV, ...): the caller builds a safer instruction set; 4 it could not start for want of a shared
library (a CUDA build on a box without the driver): not checked here; 1 any other failure. Standard
library only: deploy/build_llama_server.sh runs it before Pulse's own packages may be installed.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

CRASHED, NO_LIBRARY, FAILED = 3, 4, 1
START_TIMEOUT_S = 180.0  # the 2-core CI box loads the 270M GGUF in ~4 s; a busy one in far more


def _status(rc: int) -> int:
    if rc < 0 or rc >= 128:  # subprocess's -SIG, or a shell-style 128 + SIG
        return CRASHED
    return NO_LIBRARY if rc == 127 else FAILED


def _describe(rc: int) -> str:
    sig = -rc if rc < 0 else rc - 128 if rc >= 128 else 0
    return f"killed by {signal.Signals(sig).name}" if sig in signal.valid_signals() and sig else f"exit {rc}"


def check_version(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                         check=False)
    if out.returncode == 0:
        print(f"check: --version ok: {(out.stdout + out.stderr).strip().splitlines()[-1:]}")
        return 0
    print(f"check: --version failed ({_describe(out.returncode)}):\n{(out.stdout + out.stderr)[-1500:]}")
    return _status(out.returncode)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _one_token(proc: subprocess.Popen, url: str) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while _get(url + "/health", timeout=2.0)[0] != 200:
        if proc.poll() is not None:
            print(f"check: llama-server exited while loading the model ({_describe(proc.returncode)})")
            return _status(proc.returncode)
        if time.monotonic() > deadline:
            print(f"check: llama-server not healthy within {START_TIMEOUT_S:.0f} s")
            return FAILED
        time.sleep(0.2)
    status, body = _get(url + "/completion", {"prompt": "The capital of France is", "n_predict": 1,
                                              "top_k": 1, "cache_prompt": False}, timeout=120.0)
    if status == 200 and json.loads(body).get("tokens_predicted", 0) == 1:
        print("check: one-token generation ok")
        return 0
    if proc.poll() is not None:
        print(f"check: llama-server died generating a token ({_describe(proc.returncode)})")
        return _status(proc.returncode)
    print(f"check: /completion answered {status}: {body[:300]!r}")
    return FAILED


def check_generation(binary: str, model: str, cpu_only: bool) -> int:
    port = _free_port()
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-np", "1", "--no-ui"]
    if cpu_only:
        argv += ["-ngl", "0"]  # a CUDA build: run the CPU kernels too, where an unsupported instruction lives
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            rc = _one_token(proc, f"http://127.0.0.1:{port}")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if rc:
            log.seek(0)
            print(log.read()[-2000:].decode(errors="replace"))
        return rc


def main(argv: list[str]) -> int:
    cpu_only = "--cpu-only" in argv
    args = [a for a in argv if a != "--cpu-only"]
    if not args:
        print(__doc__)
        return 2
    rc = check_version(args[0])
    if rc or len(args) < 2:
        return rc
    return check_generation(args[0], args[1], cpu_only)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
