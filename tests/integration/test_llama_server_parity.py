"""`pulse serve --backend llama-server` against its own llama-server called directly (real Ray, real gateway,
the real binary and bundled model): greedy answers are the same both ways, and 32 concurrent streams on the
CPU box all finish with no error and without the worker ever being marked unhealthy or restarted."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.llama_server_overhead import llama_servers
from tests.conftest import PulseProcess
from tests.integration.llama_server_helpers import encode, serve_config
from workers.protocol.model import load_model_info

PROMPT = "The three primary colours are red, yellow and blue. Explain how to mix green paint, step by step:"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    # a shared 2-core box may take minutes: the queue's 429 is not under test
    config = serve_config(tmp, count=1, slots=4, kv_tokens=8192, threads=1, timeouts=False,
                          more="admission: {queue_deadline_s: 600}\n")
    srv = PulseProcess([], config, tmp).wait_ready()
    try:
        gguf = load_model_info().path
        ours = [(pid, port) for pid, port in llama_servers(srv.proc.pid) if gguf in _argv(pid)]
        assert len(ours) == 1, (ours, srv.log()[-3000:])
        yield srv, "gemma-3-270m", ours[0]
    finally:
        srv.stop()


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").split("\0")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, timeout: float = 180.0):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def test_greedy_through_pulse_equals_llama_server_direct(served):
    srv, model, (_, port) = served
    ids = encode(PROMPT)
    with _post(srv.base + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 16,
                                              "temperature": 0}) as r:
        pulse = json.loads(r.read())
    # a user's own greedy request: temperature 0, llama-server's defaults for everything else
    with _post(f"http://127.0.0.1:{port}/completion", {"prompt": ids, "n_predict": 16, "temperature": 0}) as r:
        direct = json.loads(r.read())
    assert pulse["usage"]["completion_tokens"] == direct["tokens_predicted"] > 0
    assert pulse["choices"][0]["text"] == direct["content"]


def _stream(base: str, model: str, i: int) -> tuple[int, str, list[str]]:
    body = {"model": model, "prompt": encode(f"Request {i}: name a colour and a fruit."), "max_tokens": 8,
            "temperature": 0.0 if i % 2 else 1.0, "stream": True}
    with _post(base + "/v1/completions", body) as r:
        lines = [ln.decode().strip() for ln in r if ln.strip()]
        return r.status, "".join(lines), lines


def test_32_concurrent_streams_finish_and_the_worker_stays_healthy(served):
    srv, model, (pid, _) = served
    marks: list[dict] = []
    done = threading.Event()

    def watch() -> None:  # the gateway's view of its workers, polled through the whole load
        while not done.is_set():
            try:
                marks.append(_get(srv.base + "/health").get("workers", {}))
            except urllib.error.HTTPError as e:  # 503: no healthy worker
                marks.append(json.loads(e.read() or b"{}").get("workers") or {"gateway": False})
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda i: _stream(srv.base, model, i), range(32)))
    finally:
        done.set()
        watcher.join()
    for status, text, lines in results:
        assert status == 200 and lines[-1] == "data: [DONE]", text[-500:]
        assert '"error"' not in text and '"text"' in text, text[-500:]
    assert marks and all(all(ws.values()) for ws in marks), [m for m in marks if not all(m.values())][:3]
    assert any(p == pid for p, _ in llama_servers(srv.proc.pid)), "llama-server was restarted under load"
