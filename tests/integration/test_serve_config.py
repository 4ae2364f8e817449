"""deploy/serve_config.yaml runs under Ray Serve's own `serve run` and serves like `pulse serve`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

from tests.conftest import ROOT, free_port, wait_http


def test_serve_run_with_the_repo_config(tmp_path):
    port = free_port()
    env = {**os.environ, "PULSE_WORKERS__BACKEND": "loadtest", "PULSE_WORKERS__LOADTEST__TOKENS": "5",
           "PULSE_SERVER__PORT": str(port), "PYTHONPATH": str(ROOT),
           # a new local Ray, never one a `ray start` elsewhere left recorded in /tmp/ray
           "RAY_ADDRESS": "local"}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(["serve", "run", "deploy/serve_config.yaml"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 180, proc)
        body = json.dumps({"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
