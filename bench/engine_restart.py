"""How long a worker's engine takes to come back after its process dies: what a stream handed back to the only
worker waits for (gateway/migration.py; `server.migration_wait_s` bounds that wait, 15 s by default).

The real EngineBackend with its engine in a process of its own (`workers.engine.process: on`, the GPU default),
the device profile's sizes (KV, batch, graphs), the bundled model or --model. It starts once, then --repeats times:
SIGKILL the engine process, and time until the worker is healthy on a new one (its stats from the new engine)
and until a one-token request is answered.

    python -m bench.engine_restart --profile cpu --device cpu --repeats 3
    python -m bench.engine_restart --profile h200 --device cuda --model $M --repeats 3   # the GPU machine
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time

from bench.machine import describe, machine_info
from policy.config import PulseConfig
from policy.profiles import builtin_profiles
from workers.cupy.backend import EngineBackend
from workers.protocol import GenerateRequest, SamplingParams
from workers.protocol.model import load_model_info


async def _healthy_on_a_new_engine(backend: EngineBackend, old_pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (backend._proc.proc.pid != old_pid and await backend.health() and backend.stats().healthy):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not come back within {timeout_s} s")
        await asyncio.sleep(0.02)


async def _one_token(backend: EngineBackend, rid: str) -> None:
    req = GenerateRequest(request_id=rid, prompt_ids=[2, 651, 6037], max_tokens=1,
                          sampling=SamplingParams(temperature=0.0))
    async for _ in backend.generate(req):
        pass


async def run(args) -> dict:
    config = PulseConfig.model_validate({"workers": {"engine": {"device": args.device, "process": "on"}}})
    backend = EngineBackend(config, builtin_profiles()[args.profile], load_model_info(args.model))
    t0 = time.perf_counter()
    await backend.start()
    await _one_token(backend, "first")
    first = time.perf_counter() - t0
    healthy, served = [], []
    try:
        for i in range(args.repeats):
            pid = backend._proc.proc.pid
            os.kill(pid, signal.SIGKILL)
            t0 = time.perf_counter()
            await _healthy_on_a_new_engine(backend, pid, args.timeout)
            healthy.append(time.perf_counter() - t0)
            await _one_token(backend, f"after-{i}")
            served.append(time.perf_counter() - t0)
    finally:
        await backend.close()
    return {"first_start_s": first, "healthy_s": healthy, "served_s": served}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_restart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", help="device profile (cpu, h200, gb10, ...)")
    ap.add_argument("--device", default="auto", help="the engine's device")
    ap.add_argument("--model", help="GGUF file; empty: the bundled model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="longest wait for one restart, seconds")
    args = ap.parse_args(argv)
    machine = machine_info()
    res = asyncio.run(run(args))
    print(f"{describe(machine)}; profile {args.profile}, device {args.device}, {args.repeats} kills\n")
    print("| what | median s | each run, s |\n| --- | --- | --- |")
    print(f"| first start to a served token | {res['first_start_s']:.2f} | – |")
    for key, what in (("healthy_s", "kill to healthy on a new engine"), ("served_s", "kill to a served token")):
        runs = res[key]
        print(f"| {what} | {statistics.median(runs):.2f} | {' / '.join(f'{x:.2f}' for x in runs)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
