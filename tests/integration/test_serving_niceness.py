"""The serving path runs at nice 0 under `pulse serve`, while Ray starts its other workers at nice 15.

Ray's core worker re-nices its process to `worker_niceness` (15) at start. On a busy box that left the gateway
replica and the worker actor (and the llama-server it starts) with ~1/28 of a nice-0 process's CPU share: on
the 2-core box a gateway replica took minutes to start beside two busy loops. Pulse's actors are started with
RAY_worker_niceness=0 (workers/ray_env.py); Ray's own (the Serve controller) keep 15, which is what shows here
that Ray does re-nice its workers on this box, i.e. that the check below can fail.
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from bench.procs import descendants, title
from gateway.structured import COMPILE_NICE


def _thread_nice(pid: int) -> dict[int, int]:
    """Niceness per thread (Linux keeps it per thread; Ray re-nices after starting some of its own)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        out[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
    return out


def _compile_a_schema(base: str) -> None:
    """One json_schema request, so the gateway's schema-compile threads exist (they lower themselves to
    COMPILE_NICE on purpose: gateway/structured.py)."""
    body = {"model": "gemma-3-270m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_gateway_and_workers_run_at_nice_0_and_ray_workers_at_15(loadtest_server):
    _compile_a_schema(loadtest_server.base)
    procs = {pid: title(pid) for pid in descendants(loadtest_server.proc.pid)}
    serving = [p for p, t in procs.items()
               if t.startswith(("ray::ServeReplica:pulse:GatewayIngress", "ray::WorkerActor"))]
    controller = [p for p, t in procs.items() if t.startswith("ray::ServeController")]
    assert len(serving) >= 2 and controller, procs
    for pid in serving:
        # Ray's re-nicing is the whole process's; the gateway's schema-compile threads alone sit at
        # COMPILE_NICE by Pulse's own choice
        niced = {tid: n for tid, n in _thread_nice(pid).items() if n not in (0, COMPILE_NICE)}
        assert not niced, f"{procs[pid]} (pid {pid}) has threads not at nice 0: {niced}"
    assert 15 in _thread_nice(controller[0]).values(), "Ray no longer re-nices its workers: revisit workers/ray_env.py"


def test_the_serve_controller_reconciles_once_a_second(loadtest_server):
    """`pulse serve` starts its local Ray with the Serve controller's loop at 1 s (workers/ray_env.py): the
    controller process (Ray's own worker, started by the raylet `pulse serve` started) has it in its environment."""
    procs = {pid: title(pid) for pid in descendants(loadtest_server.proc.pid)}
    (controller,) = [p for p, t in procs.items() if t.startswith("ray::ServeController")]
    env = dict(v.split(b"=", 1) for v in Path(f"/proc/{controller}/environ").read_bytes().split(b"\0") if b"=" in v)
    assert env.get(b"RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == b"1", sorted(env)


def test_ray_keeps_no_idle_workers_that_pulse_never_uses(loadtest_server):
    """Ray's raylet starts an idle Python worker per core for tasks when the first driver connects; Pulse runs
    no tasks and its actors each get a process of their own (their runtime_env), so `pulse serve` turns that off
    (workers/ray_env.py): no `ray::IDLE` process under it, each of which held ~80 MiB for the whole serve."""
    procs = {pid: title(pid) for pid in descendants(loadtest_server.proc.pid)}
    assert any(t.startswith("ray::WorkerActor") for t in procs.values()), procs  # Ray's workers are seen here
    assert not [t for t in procs.values() if t.startswith("ray::IDLE")], procs
