"""The worker's serving side at load, with the engine's compute replaced by a paced stand-in (an instrument).

A worker process runs the real EngineBackend (its engine thread, the hand-over of step outputs to asyncio,
per-request detokenizing and stop matching with the bundled Gemma 3 tokenizer, Chunk building) behind the
real StreamServer (msgspec encoding, one ndjson stream per request). Only the engine's step is a stand-in:
`PacedEngine` sleeps for a fixed step time (releasing the GIL, as a GPU step does while the device works)
and then emits one token per running sequence, up to `--batch` sequences, cycling through the ids of an
English text so the detokenizer sees real tokens. It isolates what the serving side costs per token and
whether it lets the engine thread keep its pace; it is not the product and says nothing about the GPU
engine's own Python per step, which the stand-in does not have.

Clients (this process, not the worker) stream POST /generate at 1/16/64/256 concurrent requests, closed
loop, and count the token ids they receive inside a measurement window. Per client count it prints:
delivered tok/s; the stand-in's ideal (min(clients, batch) / (step time + its Python per step)); the steps it actually ran per
second and how late, on average, its step thread ran on after each sleep (waiting for a core and for
the GIL, which the event loop holds while it serves); the worker process's CPU per delivered token, from
/proc (less the stand-in's own Python, `--engine-python-ms`); the share of a step's budget that this CPU is at one token per running sequence per step
(1.0: serving alone fills the step time); and tokens per chunk received (how much coalesced). On a crowded box the lateness (so steps/s and tok/s) moves
with the other load; CPU per token is the steadier reading.

    python -m bench.worker_path --step-ms 1.9 --batch 64 --clients 1 16 64 256 --duration 6
    python -m bench.worker_path --clients 64 --py-spy 64 [--native]   # py-spy on the worker at 64 clients
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import aiohttp
import msgspec

from bench import loops
from bench.machine import describe, machine_info
from bench.procs import Proc, cpu_ticks, free_port, owned_processes, python_module

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Write a long story about a lighthouse keeper and the ships she watched over."
# what the stand-in "generates": plain prose with a few multi-byte characters (é, —, ’) as real output has
TEXT = ("The keeper’s lamp turned all night above the harbour, and the café by the quay stayed open for "
        "the late fishermen — they came in cold, ordered soup and bread, and talked about the weather, the "
        "price of diesel, and the new breakwater that the council had promised for twenty years. ") * 8


# --- the worker process --------------------------------------------------------------------------------------
class PacedEngine:
    """Stand-in for the engine's compute: each step sleeps `step_s` (the GIL released, as during a GPU step),
    then spins `python_s` holding the GIL (the engine's own Python per step, serial to the device in this
    model; 0 by default), then gives every running sequence its next token. Requests wait beyond `batch` running ones. It speaks
    the part of Engine's interface that EngineBackend's step thread uses (add, abort, has_work, step)."""

    def __init__(self, step_s: float, batch: int, text_ids: list[int], python_s: float = 0.0):
        from workers.cupy.engine import StepOutput

        self._out = StepOutput
        self.step_s, self.batch, self.text_ids, self.python_s = step_s, batch, text_ids, python_s
        self.seqs: dict[str, list] = {}  # request id -> [request, tokens out, position in text_ids]
        self.running: list[str] = []
        self.waiting: deque[str] = deque()
        self.speculator = self.constraints = None
        self.steps = 0
        self.late_s = 0.0  # summed over steps: how much later than step_s the step thread ran on after its sleep

    def add(self, request) -> None:
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.request_id in self.seqs:
            raise ValueError(f"request id {request.request_id!r} is already running")
        start = (hash(request.request_id) & 0xFFFF) % len(self.text_ids)
        self.seqs[request.request_id] = [request, len(request.resume_ids), start]
        self.waiting.append(request.request_id)

    def abort(self, request_id: str, reason: str = "cancelled"):
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if request_id in self.running:
            self.running.remove(request_id)
        else:
            self.waiting.remove(request_id)
        return self._output(request_id, seq, [], reason)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stats_snapshot(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "slots": self.batch,
                "steps": self.steps, "late_s": self.late_s}

    def step(self) -> list:
        while self.waiting and len(self.running) < self.batch:
            self.running.append(self.waiting.popleft())
        slept = time.perf_counter()
        time.sleep(self.step_s)  # the OS's wake-up, then the GIL: waiting for it is the serving side's toll
        woke = time.perf_counter()
        self.late_s += woke - slept - self.step_s
        while time.perf_counter() - woke < self.python_s:  # pure Python: the GIL is held but for switches
            pass
        outputs, still = [], []
        for rid in self.running:
            seq = self.seqs[rid]
            token = self.text_ids[seq[2] % len(self.text_ids)]
            seq[1] += 1
            seq[2] += 1
            done = seq[1] >= seq[0].max_tokens
            if done:
                del self.seqs[rid]
            else:
                still.append(rid)
            lp = None if seq[0].logprobs is None else [_logprob(token, seq[0].logprobs)]
            outputs.append(self._output(rid, seq, [token], "length" if done else None, lp))
        self.running = still
        self.steps += 1
        return outputs

    def _output(self, rid, seq, tokens, reason, logprobs=None):
        return self._out(request_id=rid, token_ids=tokens, logprobs=logprobs, finish_reason=reason,
                         prompt_tokens=len(seq[0].prompt_ids), completion_tokens=seq[1])


def _logprob(token: int, top: int):
    from workers.protocol import TokenLogprob

    return TokenLogprob(token_id=token, logprob=-0.25, top=[(token + i, -0.25 - i) for i in range(top)])


def build_paced(step_s: float, batch: int, python_s: float = 0.0, block_sink=None) -> PacedEngine:
    """The stand-in engine (EngineBackend's engine builder: by name, so an engine process can call it too)."""
    from workers.protocol.model import load_tokenizer

    ids = load_tokenizer(None).encode(TEXT, add_special_tokens=False).ids
    return PacedEngine(step_s, batch, ids, python_s)


def paced_backend(step_s: float, batch: int, python_s: float = 0.0, process: str = "off"):
    """The real EngineBackend, its engine built as a PacedEngine (and the bundled model's real tokenizer); with
    `process` "on", in an engine process of its own (workers/cupy/engine_process.py) as a GPU worker runs it."""
    from policy.config import PulseConfig
    from policy.profiles import builtin_profiles
    from workers.cupy.backend import EngineBackend
    from workers.protocol import BackendStats
    from workers.protocol.model import load_model_info

    class PacedStats(BackendStats):
        steps: int = 0
        late_s: float = 0.0

    class PacedBackend(EngineBackend):
        engine_builder = "bench.worker_path:build_paced"

        def engine_builder_args(self) -> tuple:
            return (step_s, batch, python_s)

        def stats(self) -> BackendStats:
            snap = self.snapshot()
            return PacedStats(**snap) if snap else BackendStats(healthy=False)

    config = PulseConfig.model_validate({"workers": {"engine": {"max_num_seqs": batch, "process": process}}})
    return PacedBackend(config, builtin_profiles()["cpu"], load_model_info(None))


async def serve(args) -> None:
    from workers.stream import StreamServer

    backend = paced_backend(args.step_ms / 1000, args.batch, args.engine_python_ms / 1000, args.process)
    await backend.start()
    server = StreamServer(backend, port=args.port, secret=args.secret, worker_id="w0")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()
    await backend.close()


# --- the clients (this process) ------------------------------------------------------------------------------
class Window:
    """Token ids received between `start` and `end` (monotonic seconds), and first-token latencies."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, end
        self.tokens = 0
        self.lines = 0  # chunks (ndjson lines) that carried tokens
        self.ttft: list[float] = []
        self.errors = 0


_chunk_tokens = msgspec.json.Decoder(msgspec.defstruct("C", [("token_ids", list[int], [])]))


async def client(session, url: str, headers: dict, prompt_ids: list[int], args, win: Window, n: int) -> None:
    i = 0
    while time.monotonic() < win.end:
        body = {"request_id": f"c{n}-{i}", "prompt_ids": prompt_ids, "max_tokens": args.max_tokens,
                "ignore_eos": True}
        if args.stop:
            body["stop"] = [args.stop]
        i += 1
        sent = time.monotonic()
        first = True
        try:
            async with session.post(url + "/generate", json=body, headers=headers) as resp:
                if resp.status != 200:
                    win.errors += 1
                    await resp.read()
                    continue
                tail = b""
                async for data in resp.content.iter_any():
                    now = time.monotonic()
                    *lines, tail = (tail + data).split(b"\n")
                    counts = [len(_chunk_tokens.decode(line).token_ids) for line in lines if line]
                    got = sum(counts)
                    if first and got:
                        first = False
                        if win.start <= sent:
                            win.ttft.append(now - sent)
                    if win.start <= now <= win.end:
                        win.tokens += got
                        win.lines += sum(1 for n in counts if n)
        except aiohttp.ClientError:
            win.errors += 1


async def load(url: str, headers: dict, prompt_ids: list[int], clients: int, args) -> Window:
    now = time.monotonic()
    win = Window(now + args.warmup, now + args.warmup + args.duration)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session, url, headers, prompt_ids, args, win, n) for n in range(clients)))
    return win


def stats(url: str, headers: dict) -> dict:
    req = urllib.request.Request(url + "/stats", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.load(resp)


def wait_ready(proc: Proc, url: str, headers: dict, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"worker exited:\n{proc.log_tail()}")
        try:
            stats(url, headers)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"worker not ready after {timeout:.0f} s:\n{proc.log_tail()}")


def measure(proc: Proc, url: str, headers: dict, prompt_ids: list[int], clients: int, args) -> dict:
    """One load at `clients`; worker CPU and stand-in steps are read at the window's edges (a thread waits
    for them while the clients run on this loop)."""
    marks: dict[str, tuple] = {}
    pids = proc.tree()

    def read(name: str, at: float) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        s = stats(url, headers)
        marks[name] = (time.monotonic(), cpu_ticks(pids), s["steps"], time.process_time(), s["late_s"])

    t0 = time.monotonic()
    readers = [threading.Thread(target=read, args=("start", t0 + args.warmup)),
               threading.Thread(target=read, args=("end", t0 + args.warmup + args.duration))]
    for r in readers:
        r.start()
    win = loops.run(load(url, headers, prompt_ids, clients, args), args.loop)
    for r in readers:
        r.join()
    (ta, ca, sa, pa, la), (tb, cb, sb, pb, lb) = marks["start"], marks["end"]
    span = tb - ta
    # the serving side's CPU: the worker process's, less the stand-in's own spin (--engine-python-ms)
    cpu_s = sum(cb[p][1] - ca[p][1] for p in cb if p in ca) / os.sysconf("SC_CLK_TCK")
    cpu_s -= (sb - sa) * args.engine_python_ms / 1000
    cycle_ms = args.step_ms + args.engine_python_ms
    running = min(clients, args.batch)
    tok_s = win.tokens / span
    cpu_us = cpu_s / win.tokens * 1e6 if win.tokens else None
    ttft = sorted(win.ttft)
    return {
        "clients": clients, "tok_s": tok_s, "ideal_tok_s": running / (cycle_ms / 1000),
        "steps_s": (sb - sa) / span, "ideal_steps_s": 1000 / cycle_ms,
        "late_ms_per_step": 1000 * (lb - la) / (sb - sa) if sb > sa else None,
        "worker_cpu_cores": cpu_s / span, "cpu_us_per_token": cpu_us,
        "step_share": cpu_us * running / (args.step_ms * 1000) if cpu_us else None,
        "client_cpu_cores": (pb - pa) / span, "errors": win.errors,
        "tokens_per_chunk": win.tokens / win.lines if win.lines else None,
        "ttft_p50_ms": 1000 * ttft[len(ttft) // 2] if ttft else None,
        "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else None,
    }


def table(rows: list[dict]) -> str:
    head = ("| engine process | clients | delivered tok/s | ideal tok/s | delivered / ideal | steps/s (ideal) | step late ms | worker CPU cores | "
            "worker CPU µs/token | share of step budget | tokens/chunk | TTFT p50 / p99 ms | errors |")
    out = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        out.append(f"| {r['engine']} | {r['clients']} | {r['tok_s']:,.0f} | {r['ideal_tok_s']:,.0f} | "
                   f"{r['tok_s'] / r['ideal_tok_s']:.2f} | {r['steps_s']:.0f} ({r['ideal_steps_s']:.0f}) | "
                   f"{_f(r['late_ms_per_step'], '.2f')} | "
                   f"{r['worker_cpu_cores']:.2f} | {_f(r['cpu_us_per_token'], '.1f')} | {_f(r['step_share'], '.2f')} | "
                   f"{_f(r['tokens_per_chunk'], '.2f')} | "
                   f"{_f(r['ttft_p50_ms'], '.1f')} / {_f(r['ttft_p99_ms'], '.1f')} | {r['errors']} |")
    return "\n".join(out)


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def py_spy(pid: int, seconds: float, out: Path, native: bool) -> subprocess.Popen:
    """py-spy on the worker; with `native`, C frames too (then the event loop's idle time shows as
    epoll_pwait rather than inside Runner.run)."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
                             "200", *(["--native"] if native else []), "--format", "speedscope", "-o", str(out),
                             "--threads"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(args) -> dict:
    from workers.protocol.model import load_tokenizer

    prompt_ids = load_tokenizer(None).encode(PROMPT, add_special_tokens=False).ids
    stamp = time.strftime("%Y%m%dT%H%M%S")
    log_dir = RESULTS / f"logs-worker-path-{stamp}"
    secret = secrets.token_urlsafe(16)
    headers = {"Authorization": f"Bearer {secret}"}
    info = machine_info()
    print(describe(info), file=sys.stderr)
    rows = []
    # each engine placement in turn, each in a fresh worker, `--repeats` times alternated (same box, same hour)
    for rep, mode in [(r, m) for r in range(args.repeats) for m in args.process]:
        with owned_processes() as procs:
            port = free_port()
            proc = Proc(f"worker-{mode}-{rep}", python_module(
                "bench.worker_path", "serve", "--port", str(port), f"--secret={secret}", "--step-ms", str(args.step_ms),
                "--batch", str(args.batch), "--engine-python-ms", str(args.engine_python_ms), "--loop", args.loop,
                "--process", mode), log_dir)
            procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url, headers)
            for c in args.clients:
                spy = None
                if args.py_spy == c:
                    out = log_dir / f"py-spy-{mode}-{c}.json"
                    spy = py_spy(proc.popen.pid, args.duration, out, args.native)
                    print(f"py-spy profile -> {out}", file=sys.stderr)
                rows.append({"engine": mode, "repeat": rep, **measure(proc, url, headers, prompt_ids, c, args)})
                if spy is not None:
                    spy.wait(timeout=args.duration + 30)
                print(json.dumps(rows[-1]), file=sys.stderr)
    info["loadavg_end"] = list(os.getloadavg())
    print(table(rows))
    print(f"\n{describe(info)}; load {info['loadavg_end'][0]:.2f} at end; step {args.step_ms} ms, batch "
          f"{args.batch}, engine Python {args.engine_python_ms} ms a step, {args.max_tokens} tokens a request, window {args.duration} s after {args.warmup} s")
    result = {"args": vars(args), "machine": info, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"worker_path-{stamp}.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("serve", help="the worker process (started by the bench)")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--secret", required=True)
    for q in (p, w):
        q.add_argument("--step-ms", type=float, default=1.9, help="the stand-in's step time")
        q.add_argument("--batch", type=int, default=64, help="sequences the stand-in runs at once")
        q.add_argument("--engine-python-ms", type=float, default=0.0,
                       help="Python the stand-in runs per step holding the GIL, after its sleep (the GPU engine's own)")
        q.add_argument("--loop", default="auto", choices=loops.CHOICES, help="auto: uvloop, as Ray runs actors")
    w.add_argument("--process", default="off", choices=["off", "on"])
    p.add_argument("--process", nargs="+", default=["off"], choices=["off", "on"],
                   help="engine in the worker process (off) or in an engine process of its own (on); both: off on")
    p.add_argument("--repeats", type=int, default=1, help="runs of each --process placement, alternated")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--duration", type=float, default=6.0, help="measurement window, seconds")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--stop", default="", help="a stop string every request carries (one that never matches "
                                              "costs the matcher's work per token)")
    p.add_argument("--py-spy", type=int, default=0, metavar="CLIENTS", help="profile the worker at this load")
    p.add_argument("--native", action="store_true", help="py-spy records C frames too")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        loops.run(serve(args), args.loop)
    else:
        run(args)


if __name__ == "__main__":
    main()
