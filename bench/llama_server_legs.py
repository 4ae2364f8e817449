"""Where Pulse's time goes in front of llama-server, one leg at a time: time to first token at 1 client.

Pulse's real parts in three processes, without Ray (Ray is the control plane; no token crosses it):
- worker: workers.actor.WorkerActor (LlamaServerBackend behind the worker's StreamServer), as `pulse serve`
  starts it, with the parity bench's settings;
- gateway: gateway.ingress.build_gateway/run_gateway, given that one worker;
- this process, the client, which sends the same streaming request, one at a time, interleaved, to:
  - `v1`:      llama-server's own /v1/completions (what bench.llama_server_parity calls "direct"),
  - `native`:  llama-server's /completion with the body Pulse's backend builds (api.request_body, slot -1),
  - `channel`: the worker's /generate over the gateway's channel client (gateway/channel.py): the worker
               hop without the gateway,
  - `pulse`:   the gateway's /v1/completions (the whole path).
So native - v1 is llama-server's endpoint and body, channel - native the worker (its HTTP server, the
backend's client to llama-server, the re-framing), pulse - channel the gateway (parse, admission, routing,
the SSE relay).

With `--ray`, a fourth process hosts the same parts the way `pulse serve` does (pulse.serve.start_ray,
start_workers, deploy_gateway: the worker a Ray actor, the gateway a Serve replica, each with its own
llama-server) and three more legs join the rotation: `ray_v1` (that llama-server's /v1/completions),
`ray_channel` (the worker actor's /generate) and `ray_pulse` (the replica's /v1/completions). Then
(ray_pulse - ray_v1) - (pulse - v1) is what hosting in Ray adds, measured in the same slices of time.
`--ray-niceness 15` hosts one more such set-up whose actors start at that niceness (RAY_worker_niceness; 15
is Ray's own default, which `pulse serve` overrides: workers/ray_env.py), with legs `ray15_v1` and so on.

Per round the legs run in a rotated order; each leg's TTFT p50 per round, then the median (min-max) over
rounds, and the per-round differences.

    python -m bench.llama_server_legs --rounds 7 --requests 10
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

LEGS = ("v1", "native", "channel", "pulse")


def ray_legs(label: str) -> tuple[str, str, str]:
    return (f"{label}_v1", f"{label}_channel", f"{label}_pulse")


def config_json(log_dir: str, threads: int | None, slots: int | None, extra_args: list[str] | None = None) -> str:
    ls: dict = {"log_dir": log_dir}
    if extra_args:
        ls["extra_args"] = extra_args
    if threads:
        ls["threads"] = threads
    if slots:
        ls["slots"] = slots
    return json.dumps({"model": {"path": "gemma-3-270m", "name": "gemma-3-270m"},
                       "workers": {"backend": "llama-server", "count": 1, "llama_server": ls}})


async def _serve_worker(cfg: str) -> None:
    from workers.actor import WorkerActor
    from workers.protocol import encode

    actor = WorkerActor(cfg, "w0")
    info = await actor.start()
    lane = actor.backend.lanes[0]
    print(json.dumps({"info": json.loads(encode(info)), "llama_url": lane.process.url}), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    finally:
        await actor.close()


async def _serve_gateway(cfg: str, info_json: str, port: int) -> None:
    import msgspec

    from gateway.ingress import build_gateway, run_gateway
    from policy.config import PulseConfig
    from workers.protocol import WorkerInfo

    info = msgspec.json.decode(info_json.encode(), type=WorkerInfo)

    async def discover(worker_id):
        return [info]

    runner, _ = await run_gateway(build_gateway(PulseConfig.model_validate_json(cfg), discover), "127.0.0.1", port)
    print(json.dumps({"port": port}), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await runner.cleanup()


def _serve_ray(cfg: str, port: int, niceness: int | None = None) -> None:
    """`pulse serve`'s set-up (pulse/serve.py), in this process: the Ray driver. `niceness`: start the actors
    at this niceness instead of the serving path's."""
    import ray

    from workers import ray_env

    if niceness is not None:
        ray_env.SERVING_ENV = {"RAY_worker_niceness": str(niceness)}

    from bench.llama_server_overhead import llama_servers
    from policy.config import PulseConfig
    from pulse.serve import (
        _shutdown,
        deploy_gateway,
        start_ray,
        start_workers,
        wait_healthy,
    )
    from workers.protocol import encode

    out = os.fdopen(os.dup(1), "w")  # the parent reads one line there; Ray's own output goes to stderr
    os.dup2(2, 1)
    config = PulseConfig.model_validate_json(cfg)
    config.server.host, config.server.port = "127.0.0.1", port
    start_ray(config)
    actors: list = []
    try:
        actors, names = start_workers(config, 0)
        info = ray.get(actors[0].start.remote())
        base = deploy_gateway(config, names)
        if not wait_healthy(base + "/health", 120):
            raise RuntimeError("the gateway replica did not become healthy")
        (_, llama_port), = llama_servers(os.getpid())
        print(json.dumps({"info": json.loads(encode(info)), "llama_url": f"http://127.0.0.1:{llama_port}",
                          "port": port}), file=out, flush=True)
        sys.stdin.read()  # until the parent closes it
    finally:
        _shutdown(actors)


def _child(args: list[str]) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-m", "bench.llama_server_legs", *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{args[:2]} exited with {p.wait()}")
        if line.startswith("{"):
            return p, json.loads(line)


async def _ttft_sse(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Send to the first `data:` event with text (an OpenAI `text` or llama-server's `content`)."""
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                text = ev.get("content") or (ev.get("choices") or [{}])[0].get("text")
                if text:
                    ttft = time.perf_counter() - t0
    return ttft


async def _ttft_channel(channels, info: dict, body: bytes) -> float:
    t0 = time.perf_counter()
    ttft = None
    stream = await channels.open(info["url"], "/generate", body, info["secret"])
    try:
        if stream.status != 200:
            raise RuntimeError(await stream.body())
        async for batch in stream.batches():
            if ttft is None and any(c.text for c in batch):
                ttft = time.perf_counter() - t0
            if any(c.finish_reason for c in batch):
                break
    finally:
        stream.close()
    return ttft


async def measure(args, info: dict, llama_url: str, gateway_url: str,
                  hosts: dict[str, dict] | None = None) -> dict[str, list[float]]:
    from bench.llama_server_overhead import prompt_ids
    from gateway.channel import Channels
    from workers.llama_server import api
    from workers.protocol import GenerateRequest, SamplingParams, encode

    ids = prompt_ids(args.prompt_tokens)
    oai = {"model": "gemma-3-270m", "prompt": ids, "max_tokens": args.tokens, "temperature": 0.0, "stream": True}
    gen = GenerateRequest(request_id="x", model="gemma-3-270m", prompt_ids=ids, max_tokens=args.tokens,
                          sampling=SamplingParams(temperature=0.0))
    native = json.loads(api.request_body(gen, None))
    close = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))  # as Pulse's backend does
    keep = aiohttp.ClientSession()  # the parity bench's client keeps its connection to Pulse
    channels = Channels()
    n = 0

    async def one(leg: str) -> float:
        nonlocal n
        n += 1
        if leg == "v1":
            return await _ttft_sse(close, llama_url + "/v1/completions", oai)
        if leg == "native":
            return await _ttft_sse(close, llama_url + "/completion", native)
        if leg == "channel":
            gen.request_id = f"legs-{n}"
            return await _ttft_channel(channels, info, encode(gen))
        if leg == "pulse":
            return await _ttft_sse(keep, gateway_url + "/v1/completions", oai)
        label, part = leg.rsplit("_", 1)
        host = hosts[label]
        if part == "v1":
            return await _ttft_sse(close, host["llama_url"] + "/v1/completions", oai)
        if part == "channel":
            gen.request_id = f"legs-{n}"
            return await _ttft_channel(channels, host["info"], encode(gen))
        return await _ttft_sse(keep, f"http://127.0.0.1:{host['port']}/v1/completions", oai)

    legs = LEGS + tuple(leg for label in (hosts or {}) for leg in ray_legs(label))
    per_round: dict[str, list[float]] = {leg: [] for leg in legs}
    try:
        for r in range(args.warmup + args.rounds):
            order = legs[r % len(legs):] + legs[: r % len(legs)]
            got: dict[str, list[float]] = {leg: [] for leg in legs}
            for _ in range(args.requests):  # legs alternate request by request: they share every slice of time
                for leg in order:
                    got[leg].append(await one(leg) * 1000)
            if r >= args.warmup:
                for leg in legs:
                    per_round[leg].append(statistics.median(got[leg]))
            if not args.quiet:
                print(f"round {r}{' (warm-up)' if r < args.warmup else ''}: "
                      + ", ".join(f"{leg} {statistics.median(got[leg]):.2f}" for leg in legs), flush=True)
    finally:
        await close.close()
        await keep.close()
        await channels.close()
    return per_round


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):+.2f} ({min(xs):+.2f} .. {max(xs):+.2f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_server_legs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["client", "worker", "gateway", "ray"], default="client", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--info", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--niceness", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--requests", type=int, default=10, help="requests per leg per round")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t (0: llama-server's default)")
    ap.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                    help="an argument appended to llama-server's command line (repeat it: --llama-arg=--poll "
                         "--llama-arg=0)")
    ap.add_argument("--slots", type=int, default=None, help="llama-server -np (default: the profile's)")
    ap.add_argument("--ray", action="store_true",
                    help="also host a worker and gateway in Ray as `pulse serve` does, and measure them beside")
    ap.add_argument("--ray-niceness", type=int, nargs="*", default=[],
                    help="also host one Ray set-up per value, its actors started at that niceness")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.role == "worker":
        asyncio.run(_serve_worker(args.config))
        return 0
    if args.role == "gateway":
        asyncio.run(_serve_gateway(args.config, args.info, args.port))
        return 0
    if args.role == "ray":
        _serve_ray(args.config, args.port, args.niceness)
        return 0

    from bench.machine import checked_machine_info
    from bench.procs import free_port

    checked_machine_info()
    cfg = config_json(tempfile.mkdtemp(prefix="pulse-legs-"), args.threads, args.slots, args.llama_arg)
    load = os.getloadavg()
    with contextlib.ExitStack() as stack:
        def child(role_args: list[str], wait_s: float) -> dict:
            proc, said = _child(role_args)
            stack.callback(proc.wait, wait_s)
            stack.callback(proc.stdin.close)
            return said

        w = child(["--role", "worker", "--config", cfg], 60)
        g = child(["--role", "gateway", "--config", cfg, "--info", json.dumps(w["info"]), "--port", str(free_port())],
                  30)
        hosts = {}
        if args.ray:
            hosts["ray"] = child(["--role", "ray", "--config", cfg, "--port", str(free_port())], 90)
        for nice in args.ray_niceness:
            hosts[f"ray{nice}"] = child(["--role", "ray", "--config", cfg, "--port", str(free_port()),
                                         "--niceness", str(nice)], 90)
        per_round = asyncio.run(measure(args, w["info"], w["llama_url"], f"http://127.0.0.1:{g['port']}", hosts))
    print(f"load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}; {args.rounds} rounds x "
          f"{args.requests} requests per leg, {args.tokens} tokens, {args.prompt_tokens}-token cached prompt")
    print("TTFT p50 ms, median (min .. max) over rounds:")
    for leg in per_round:
        xs = per_round[leg]
        print(f"  {leg:8s} {statistics.median(xs):8.2f} ({min(xs):.2f} .. {max(xs):.2f})")
    print("added, per round:")
    for a, b, what in (("native", "v1", "llama-server endpoint and body"), ("channel", "native", "worker hop"),
                       ("pulse", "channel", "gateway"), ("pulse", "v1", "all of Pulse")):
        print(f"  {a} - {b:8s} {_fmt(_minus(per_round, a, b))} ms  ({what})")
    for label in hosts:
        v1, channel, pulse = ray_legs(label)
        for x, y, what in ((channel, v1, "worker hop"), (pulse, channel, "gateway"), (pulse, v1, "all of Pulse")):
            print(f"  {x} - {y:8s} {_fmt(_minus(per_round, x, y))} ms  ({what}, in Ray: {label})")
    if hosts:
        print("what hosting in Ray adds, per round:")
        for label in hosts:
            v1, channel, pulse = ray_legs(label)
            for leg, ray_leg, ray_ref in (("channel", channel, v1), ("pulse", pulse, v1)):
                xs = [(rx - rr) - (x - r) for rx, rr, x, r in
                      zip(per_round[ray_leg], per_round[ray_ref], per_round[leg], per_round["v1"])]
                print(f"  ({ray_leg} - {ray_ref}) - ({leg} - v1) {_fmt(xs)} ms")
    return 0


def _minus(per_round: dict[str, list[float]], a: str, b: str) -> list[float]:
    return [x - y for x, y in zip(per_round[a], per_round[b])]


if __name__ == "__main__":
    raise SystemExit(main())
