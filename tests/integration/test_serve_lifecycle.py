"""`pulse serve` starts, drains on SIGTERM, and leaves no process behind (Ray's included)."""
from __future__ import annotations

import json
import os
import threading
import urllib.request
from pathlib import Path

from tests.conftest import LOADTEST_CONFIG, PulseProcess


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


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
