"""`pulse serve` starts, drains on SIGTERM, and leaves no process behind (Ray's included)."""
from __future__ import annotations

import json
import os
import threading
import urllib.request
from pathlib import Path

from bench.procs import alive, descendants
from tests.conftest import LOADTEST_CONFIG, PulseProcess


def test_sigterm_drains_and_leaves_nothing_behind(tmp_path):
    srv = PulseProcess([], LOADTEST_CONFIG, tmp_path).wait_ready()
    procs = descendants(srv.proc.pid)
    assert len(procs) >= 3, "expected Ray's processes under pulse serve"
    # an in-flight stream started before SIGTERM finishes within the grace period
    result: dict = {}

    def stream() -> None:
        body = json.dumps({"model": "gemma-3-270m", "messages": [{"role": "user", "content": "x"}],
                           "max_tokens": 600}).encode()
        req = urllib.request.Request(srv.base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            result["status"], result["body"] = r.status, json.loads(r.read())

    t = threading.Thread(target=stream)
    t.start()
    import time

    time.sleep(0.5)
    assert srv.stop() == 0, srv.log()[-3000:]
    t.join(30)
    assert result.get("status") == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 600
    left = [p for p in procs if alive(p)]
    assert not left, f"processes left behind: {[Path(f'/proc/{p}/cmdline').read_bytes()[:80] for p in left]}"
    assert os.waitpid is not None
