"""`pulse serve --backend llama-server --workers 2` end to end: real Ray, real gateway, two real
llama-server processes running the bundled model; stopping it leaves no llama-server behind."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from bench.procs import descendants
from tests.conftest import PulseProcess
from tests.integration.llama_server_helpers import llama_server_binary, pid_alive


def llama_servers() -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                exe = (d / "cmdline").read_bytes().split(b"\0", 1)[0]
            except OSError:
                continue
            if exe.endswith(b"/llama-server"):
                out.add(int(d.name))
    return out


def chat(base: str, content: str, stream: bool = False) -> tuple[dict | str, dict]:
    body = json.dumps({"model": "gemma-3-270m", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 12, "temperature": 0, "stream": stream}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
        return (raw if stream else json.loads(raw)), dict(r.headers)


def test_pulse_serve_with_two_llama_server_workers(tmp_path):
    binary = llama_server_binary()
    config = f"""
model: {{name: gemma-3-270m}}  # one model (a config naming none serves both bundled ones)
workers:
  backend: llama-server
  count: 2
  llama_server: {{binary: "{binary}", slots: 2, kv_tokens: 4096, log_dir: "{tmp_path}"}}
server:
  drain_grace_s: 5
"""
    srv = PulseProcess([], config, tmp_path).wait_ready()
    try:
        # the ones this `pulse serve` started (under its Ray workers), not another on the box
        ours = llama_servers() & set(descendants(srv.proc.pid))
        assert len(ours) == 2, srv.log()[-3000:]
        body, headers = chat(srv.base, "Name three colours.")
        assert body["choices"][0]["message"]["content"].strip(), body
        assert body["usage"]["completion_tokens"] > 0 and headers.get("x-pulse-worker")
        text, _ = chat(srv.base, "Name three animals.", stream=True)
        assert text.rstrip().endswith("data: [DONE]") and '"content"' in text
        # the same conversation three times over two workers: one worker sees it twice and serves the
        # second from its slot's cache
        question = "Name three colours, and for each one say where it is seen in nature. " * 2
        usages = [chat(srv.base, question)[0]["usage"] for _ in range(3)]
        assert any(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages[1:]), usages
        # each worker takes as many requests beyond its 2 slots as slots (its own queue_max), not the gateway's 4
        with urllib.request.urlopen(srv.base + "/pulse/status", timeout=30) as r:
            workers = json.loads(r.read())["workers"]
        assert [(w["slots"], w["queue"]) for w in workers] == [(2, 2), (2, 2)], workers
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()[-3000:]
    assert not [p for p in ours if pid_alive(p)]
