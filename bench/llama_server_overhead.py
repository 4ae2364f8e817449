"""Pulse in front of llama-server: the time to first token it adds over calling llama-server directly (issue 5).

One run starts `pulse serve --backend llama-server` (one worker, the bundled model, loopback) and, at each
client count, interleaved per the protocol (warm-up discarded, order rotated, >= 5 repeats):
- direct: streaming POST /completion to the very llama-server process Pulse's worker manages (found among
  `pulse serve`'s descendants by its command line; its port is on it), with the body Pulse's backend builds
  for the same request (`workers.llama_server.api.request_body`), so binary, flags, model, slots, KV state
  and sampling settings are the same and only the path differs;
- pulse: streaming POST /v1/completions to Pulse with the same token ids, max_tokens and temperature 0.
Added TTFT = pulse - direct within the same repeat (p50 from p50s, p99 from p99s). Goal: <= 2 ms p50 at 1
and 32 clients.

    python -m bench.llama_server_overhead --repeats 5 --warmup 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench import loops, protocol
from bench.gateway_overhead import _load_with_cpu, config_name, first_model
from bench.gateway_overhead import summarize as overhead_summary
from bench.loadgen import LoadSpec
from bench.machine import REPO, checked_machine_info
from bench.procs import Proc, descendants, free_port, owned_processes, python_module

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_P50_MS = 2.0
TARGETS = ("direct", "pulse")
TABLE_METRICS = ["ttft_p50_ms", "ttft_p99_ms", "added_ttft_p50_ms", "added_ttft_p99_ms", "req_s",
                 "tokens_per_req", "path_cpu_ms_per_req", "errors"]
PLOT_METRICS = ["ttft_p50_ms", "added_ttft_p50_ms", "added_ttft_p99_ms"]
PROMPT = "Summarise the plot of Hamlet in one paragraph, naming the main characters. "


class Pid:
    """One process by pid, where bench.gateway_overhead's CPU accounting wants a Proc."""

    def __init__(self, pid: int):
        self.pid = pid

    def tree(self) -> list[int]:
        return [self.pid, *descendants(self.pid)]


def config_yaml(args, log_dir: Path) -> str:
    ls = {"slots": args.slots, "kv_tokens": args.kv_tokens, "log_dir": str(log_dir)}
    if args.threads:
        ls["threads"] = args.threads
    if args.binary:
        ls["binary"] = args.binary
    # one model (a config naming none serves both bundled ones)
    return json.dumps({"model": {"name": "gemma-3-270m"}, "workers": {"backend": "llama-server", "count": 1,
                                                                     "llama_server": ls}})  # JSON is YAML


def llama_servers(root: int) -> list[tuple[int, int]]:
    """(pid, port) of every llama-server among root's descendants, from their command lines."""
    out = []
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith("llama-server") and "--port" in argv:
            out.append((pid, int(argv[argv.index("--port") + 1])))
    return out


def the_worker_server(pulse: Proc, timeout: float = 60.0) -> tuple[int, int]:
    """The one llama-server Pulse's worker runs (pid, port); more than one means the set-up is not ours."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = llama_servers(pulse.popen.pid)
        if len(found) > 1:
            raise RuntimeError(f"expected one llama-server under pulse serve, found {found}")
        if found:
            return found[0]
        time.sleep(0.5)
    raise RuntimeError(f"no llama-server under pulse serve after {timeout:.0f} s:\n{pulse.log_tail()}")


def prompt_ids(words: int, model: str | None = None) -> list[int]:
    """BOS + the tokenized prompt, cut to `words` tokens: the same ids go both ways. `model`: a GGUF path or a
    bundled model's name (default: the bundled default)."""
    from workers.protocol.model import load_model_info, load_tokenizer

    ids = load_tokenizer(model).encode(PROMPT * (1 + words // 10), add_special_tokens=False).ids[: words - 1]
    return [load_model_info(model).bos_token_id, *ids]


def direct_body(ids: list[int], max_tokens: int) -> dict:
    """What Pulse's backend POSTs for this request (the slot left to llama-server, as when all are busy)."""
    from workers.llama_server import api
    from workers.protocol import GenerateRequest, SamplingParams

    req = GenerateRequest(request_id="bench", prompt_ids=ids, max_tokens=max_tokens,
                          sampling=SamplingParams(temperature=0.0))
    return msgspec.json.decode(api.request_body(req, None))


def specs(args, ids: list[int], pulse_url: str, model: str, direct_url: str) -> dict[str, LoadSpec]:
    out = {}
    body = direct_body(ids, args.tokens)
    for c in args.clients:
        requests = max(args.min_requests, c * args.requests_per_client)  # enough for a p50 at 1 client too
        common = dict(clients=c, duration=args.duration, requests=requests,
                      max_tokens=args.tokens, prompt=ids, timeout=args.timeout)
        # one connection per request, as Pulse's backend does: cpp-httplib closes kept-alive connections
        # under it (every second direct request failed with ClientOSError when they were reused)
        out[config_name("direct", c)] = LoadSpec(url=direct_url, api="llama", body_extra=body, force_close=True,
                                                 **common)
        out[config_name("pulse", c)] = LoadSpec(url=pulse_url, api="completions", model=model, **common)
    return out


async def _measure(spec: LoadSpec, path: list, pulse: Proc) -> dict:
    if pulse.popen.poll() is not None:  # measuring a dead server would only record connection errors
        raise RuntimeError(f"pulse serve exited with {pulse.popen.returncode}:\n{pulse.log_tail()}")
    out = await _load_with_cpu(spec, path)
    m = out["metrics"]
    m["tokens_per_req"] = m["tok_s"] * m["wall_s"] / m["ok"] if m["ok"] else None
    return out


def verdict(summary: dict, clients: Sequence[int]) -> list[str]:
    """One line per client count: the median over repeats of the added p50 TTFT against the goal."""
    lines = []
    for c in clients:
        s = summary.get(config_name("pulse", c), {}).get("added_ttft_p50_ms")
        if s is None:
            lines.append(f"NONE {c} clients: no added_ttft_p50_ms (a target served nothing)")
            continue
        ok = s["median"] <= GOAL_P50_MS
        lines.append(f"{'MET ' if ok else 'MISS'} {c} clients: added_ttft_p50_ms median {s['median']:.2f} "
                     f"(min {s['min']:.2f}, max {s['max']:.2f}; goal <= {GOAL_P50_MS:g})")
    return lines


def summarize(records: list[dict], clients: Sequence[int]) -> dict:
    return overhead_summary(records, TARGETS, clients)


def report(args, records, params, machine, started) -> dict:
    summary = summarize(records, args.clients)
    return protocol.publish("llama_server_overhead", records, summary, params, started, machine, verdict(summary, args.clients),
                            TABLE_METRICS, PLOT_METRICS, args.out)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_server_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=4, help="max_tokens per request (small: 32 CPU clients must finish)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (cached after warm-up)")
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests per client per run")
    ap.add_argument("--min-requests", type=int, default=16, help="at least this many requests per run")
    ap.add_argument("--duration", type=float, default=60.0, help="cap on seconds of load per run")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request")
    ap.add_argument("--slots", type=int, default=32, help="llama-server -np: as many as clients, so none queues")
    ap.add_argument("--kv-tokens", type=int, default=8192, help="llama-server -c, shared by the slots")
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t (default: Pulse's, the cores)")
    ap.add_argument("--binary", default=None, help="llama-server to run (default: Pulse's cached build)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--loop", choices=loops.CHOICES, default="auto", help="the load generator's event loop")
    protocol.add_arguments(ap, RESULTS)
    return ap.parse_args(argv)


def start_pulse(config: str, log_dir: Path, procs: list, start_timeout: float, env: dict[str, str] | None = None
                ) -> tuple[Proc, str, int, int]:
    """`pulse serve` with `config` (written to log_dir), healthy: (its process, its URL, and the pid and port of
    the llama-server its one worker runs, for the same requests sent direct). `env`: more variables for it (e.g. an
    OTLP receiver's)."""
    (log_dir / "pulse.yaml").write_text(config)
    port = free_port()
    # `python -m pulse.cli` from this checkout, not whatever `pulse` is first on PATH
    pulse = Proc("pulse", python_module("pulse.cli", "serve", "--config", str(log_dir / "pulse.yaml"),
                                        "--host", "127.0.0.1", "--port", str(port)), log_dir,
                 env={**(env or {}),
                      "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))})
    procs.append(pulse)
    pulse_url = f"http://127.0.0.1:{port}"
    pulse.wait_healthy(pulse_url + "/health", timeout=start_timeout)
    return (pulse, pulse_url, *the_worker_server(pulse))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    machine, started = checked_machine_info(), time.time()
    log_dir = args.out / f"logs-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with owned_processes() as procs:
        pulse, pulse_url, llama_pid, llama_port = start_pulse(config_yaml(args, log_dir), log_dir, procs,
                                                              args.start_timeout)
        direct_url = f"http://127.0.0.1:{llama_port}"
        ids = prompt_ids(args.prompt_tokens)
        paths = {"direct": [Pid(llama_pid)], "pulse": [pulse]}
        runs = {name: (lambda s=s, p=paths[name.split("@")[0]]: _measure(s, p, pulse))
                for name, s in specs(args, ids, pulse_url, first_model(pulse_url), direct_url).items()}
        records = loops.run(protocol.run(runs, args.repeats, args.warmup, not args.quiet), args.loop)
        same = llama_servers(pulse.popen.pid) == [(llama_pid, llama_port)]  # no restart spoiled the pairing
        params = vars(args) | {"llama_server": {"pid": llama_pid, "port": llama_port, "same_process_at_end": same},
                               "prompt_ids": ids, "loop": loops.resolve(args.loop)}
        report(args, records, params, machine, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
