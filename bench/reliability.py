"""Load soak for the reliability suite: N concurrent streams for T seconds, the load-test backend or a real one.

    python -m bench.reliability load --streams 1000 --seconds 60
    python -m bench.reliability load --backend llama-server --streams 32 --seconds 600 --warmup 60   # a real model
    python -m bench.reliability kill --streams 32 --repeats 3    # a worker killed under load: streams lost
    python -m bench.reliability kill --backend llama-server --streams 16 --kill llama-server   # its child only

Starts `pulse serve --backend loadtest` (slots for every stream, a token rate that keeps each stream busy
for seconds), runs N closed-loop streaming clients (one aiohttp session, connector sized to N) for a
warm-up and then the measured window, samples the RSS of the gateway replica and of each worker process
once a second, and afterwards checks that no slot is held. Passes when the only errors are explicit 429s,
RSS growth over the measured window (after the warm-up) is under 10% for every process, and nothing leaked.

With `--backend llama-server` or `cupy` it soaks a real model instead, as `pulse serve` ships (no settings but the
backend: both bundled models, the box's device profile): each client's requests rotate over a chat question, a
story completion, a code edit, a JSON-schema chat and an Anthropic message, every prompt distinct, with the sampling
settings the SDKs send (none: temperature 1), each request checked whole (200, a finish reason, `[DONE]`, no error
event); a client refused with 429 waits its Retry-After (at most 10 s) as the SDKs do. It also samples the RSS of each
worker's llama-server and the gateway's view of every worker once a second, and fails on any sample that had a
worker not routable (a busy worker marked unhealthy).
Writes bench/results/reliability-load-<time>.json and prints a Markdown summary.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from bench import loops
from bench.faults import (
    CHAT,
    MESSAGES,
    MODEL,
    both_serving,
    child_pids,
    kill_under_streams,
    listening_pids,
    port_of,
    rss_bytes,
    settled_idle,
    stream_chat,
    stream_messages,
    wait_until,
    workers,
)
from bench.procs import free_port
from bench.loadgen import LoadSpec, RequestResult, one_request, percentiles, request_body
from bench.machine import machine_info
from bench.procs import Proc, python_module
from bench.protocol import command_line
from bench.served import SCHEMA, SUBJECTS, prompt_at
from workers.llama_server.flags import setting
from workers.llama_server.lane import LLAMA_CACHE_RAM_MIB

OUT = Path(__file__).resolve().parent / "results"
MAX_RSS_GROWTH = 0.10


@dataclass
class Soak:
    streams: int = 1000
    seconds: float = 60.0
    warmup_s: float = 15.0
    tokens: int = 32  # per request
    tokens_per_s: float = 4.0  # per stream: 32 tokens take ~8 s, so every client is mid-stream nearly always
    backend: str = "loadtest"  # or a real one: llama-server, cupy


REAL_TIMEOUT_S = 180.0  # a real request's bound, queueing included: beyond it the soak counts a hang
RETRY_AFTER_MAX_S = 10.0
REAL_KINDS = ("chat", "story", "code", "json", "messages")
CHAT_MODEL, BASE_MODEL = "smollm2-135m-instruct", "gemma-3-270m"  # the bundled models `pulse serve` serves


def real_request(i: int, tokens: int) -> tuple[str, dict]:
    """(path, body) of a real soak's i-th request: a chat question, a story, a code edit, a JSON-schema chat or an
    Anthropic message in turn, every prompt distinct, stories on both bundled models; no sampling settings (the
    SDKs' defaults: temperature 1)."""
    kind, n = REAL_KINDS[i % len(REAL_KINDS)], i // len(REAL_KINDS)
    if kind == "messages":  # an agent on Anthropic's API (max_tokens is required there)
        text = f"Task {n}: list three things to check before renaming a function used by {SUBJECTS[n % len(SUBJECTS)]}."
        return MESSAGES, {"model": CHAT_MODEL, "max_tokens": tokens, "stream": True,
                          "messages": [{"role": "user", "content": text}]}
    common = {"max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        text = f"Question {n}: what would {SUBJECTS[n % len(SUBJECTS)]} find hardest about city life?"
        return CHAT, {"model": CHAT_MODEL, "messages": [{"role": "user", "content": text}], **common}
    if kind == "json":
        return CHAT, {"model": CHAT_MODEL, "messages": [{"role": "user", "content": prompt_at("json", n)}],
                      "response_format": {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA}},
                      **common}
    model = BASE_MODEL if kind == "story" and n % 2 == 0 else CHAT_MODEL
    return "/v1/completions", {"model": model, "prompt": prompt_at(kind, n), **common}


async def real_one(session: aiohttp.ClientSession, base: str, i: int, tokens: int) -> tuple[RequestResult, float]:
    """One real soak request as a RequestResult (an accepted request that did not end whole is an error), and
    how long its client waits before the next (a 429's Retry-After)."""
    path, body = real_request(i, tokens)
    if path == MESSAGES:
        seen = await stream_messages(session, base, body, timeout_s=REAL_TIMEOUT_S)
    else:
        seen = await stream_chat(session, base, body, timeout_s=REAL_TIMEOUT_S, path=path)
    r = RequestResult(status=seen.status, ttft=seen.first, total=seen.seconds,
                      tokens=(seen.usage or {}).get("completion_tokens", 0))
    if seen.exception:
        r.error = seen.exception
    elif seen.status == 200 and not seen.complete:
        r.error = "incomplete stream" if not seen.error_events else "error event"
    wait = 0.0
    if seen.status == 429:
        try:
            wait = min(float(seen.retry_after or 1), RETRY_AFTER_MAX_S)
        except ValueError:
            wait = 1.0
    return r, wait


def server_config(soak: Soak) -> str:
    if soak.backend != "loadtest":  # as shipped: the backend named, nothing else
        return f"""
workers:
  backend: {soak.backend}
server:
  drain_grace_s: 2
"""
    return f"""
model: {{name: gemma-3-270m}}  # one model (a config naming none serves both bundled ones)
workers:
  backend: loadtest
  loadtest: {{tokens: {soak.tokens}, tokens_per_s: {soak.tokens_per_s}, slots: {2 * soak.streams}}}
server:
  drain_grace_s: 2
"""


def raise_fd_limit(need: int) -> None:
    """Each stream is a socket here (and two in the server): lift the soft fd limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else hard, hard))


async def server_pids(session: aiohttp.ClientSession, base: str) -> dict[str, int]:
    """{'gateway': pid, worker_id: pid, ...}: the processes listening on the gateway's and workers' ports."""
    pids = {"gateway": sorted(listening_pids(port_of(base)))}
    for w in await workers(session, base):
        pids[w["worker_id"]] = sorted(listening_pids(port_of(w["url"])))
    out = {}
    for name, found in pids.items():
        if len(found) != 1:
            raise RuntimeError(f"expected one process for {name}, found {found}")
        out[name] = found[0]
    return out


def with_children(pids: dict[str, int], name: str = "llama-server") -> dict[str, int]:
    """`pids` and each worker's child named `name` (its llama-server), as '<worker>/<name>'."""
    out = dict(pids)
    for w, pid in pids.items():
        if w != "gateway":
            for i, child in enumerate(child_pids(pid, name)):
                out[f"{w}/{name}" + (f"#{i}" if i else "")] = child
    return out


async def _sample(pids: dict[str, int], series: dict[str, list[tuple[float, int]]], t0: float, stop: asyncio.Event,
                  view=None):
    """RSS of every process once a second; with `view` (an async callable), the gateway's worker rows too."""
    while not stop.is_set():
        now = time.monotonic() - t0
        for name, pid in pids.items():
            series.setdefault(name, []).append((round(now, 2), rss_bytes(pid)))
        if view is not None:
            await view()
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def _at(series: list[tuple[float, int]], t: float) -> int:
    """The sample nearest to time t."""
    return min(series, key=lambda s: abs(s[0] - t))[1]


def memory_report(series: dict[str, list[tuple[float, int]]], start: float, end: float) -> dict:
    out = {}
    for name, samples in series.items():
        a, b = _at(samples, start), _at(samples, end)
        peak = max(v for t, v in samples if start <= t <= end + 1)
        out[name] = {"rss_start_mib": round(a / 2**20, 1), "rss_end_mib": round(b / 2**20, 1),
                     "rss_peak_mib": round(peak / 2**20, 1), "growth": round(b / a - 1, 4) if a else None}
    return out


async def drive(base: str, soak: Soak, progress: bool = False) -> dict:
    """Run the soak against a running server; returns the figures and a verdict."""
    raise_fd_limit(4 * soak.streams + 256)
    real = soak.backend != "loadtest"
    spec = LoadSpec(url=base, model=MODEL, max_tokens=soak.tokens, stream=True,
                    timeout=REAL_TIMEOUT_S + 10 if real else 60)
    path, body = request_body(spec)
    connector = aiohttp.TCPConnector(limit=soak.streams + 16)
    timeout = aiohttp.ClientTimeout(total=spec.timeout)
    measured: list[RequestResult] = []
    all_status: Counter = Counter()
    all_errors: Counter = Counter()
    series: dict[str, list[tuple[float, int]]] = {}
    not_routable: Counter = Counter()  # samples of the gateway's view in which a worker was not routable
    views = [0]
    numbered = itertools.count()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        pids = await server_pids(session, base)
        if real:
            pids = with_children(pids)

        async def view() -> None:
            views[0] += 1
            for w in await workers(session, base):
                if not w["routable"]:
                    not_routable[w["worker_id"]] += 1

        t0 = time.monotonic()
        start, end = t0 + soak.warmup_s, t0 + soak.warmup_s + soak.seconds
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(pids, series, t0, stop, view if real else None))

        async def client() -> None:
            while (began := time.monotonic()) < end:
                wait = 0.0
                if real:
                    r, wait = await real_one(session, base, next(numbered), soak.tokens)
                else:
                    r = await one_request(session, base + path, body, True)
                all_status[r.status] += 1
                if r.status != 429 and (r.status != 200 or r.error):
                    all_errors[r.error or str(r.status)] += 1
                if began >= start:
                    measured.append(r)
                if wait:
                    await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))

        ticker = asyncio.create_task(_progress(t0, end, measured, all_errors)) if progress else None
        await asyncio.gather(*(client() for _ in range(soak.streams)))
        drained = time.monotonic()
        stop.set()
        await sampler
        if ticker:
            ticker.cancel()
        to_idle = await settled_idle(session, base, timeout_s=10)
        rows = await workers(session, base)
    doc = report(soak, measured, all_status, all_errors, series, (start - t0, end - t0), drained - end, to_idle,
                 rows, pids)
    if real:
        doc["gateway_views"], doc["not_routable_samples"] = views[0], dict(not_routable)
        if not_routable:
            doc["failures"].append(f"workers not routable in {sum(not_routable.values())} of {views[0]} samples of "
                                   f"the gateway's view: {dict(not_routable)}")
    return doc


async def _progress(t0: float, end: float, measured: list, errors: Counter) -> None:
    while True:
        await asyncio.sleep(10)
        print(f"  {time.monotonic() - t0:5.0f} s  measured requests {len(measured)}  errors {sum(errors.values())}"
              f"  ({max(0.0, end - time.monotonic()):.0f} s left)", file=sys.stderr, flush=True)


def report(soak: Soak, measured, status, errors, series, window, drain_s, to_idle, rows, pids) -> dict:
    ok = [r for r in measured if r.status == 200 and not r.error]
    memory = memory_report(series, *window)
    for name, m in memory.items():
        if name.endswith("/llama-server"):
            m["prompt_cache_mib"] = prompt_cache_mib(pids[name])
    leaked = {w["worker_id"]: {"running": w["stats"]["running"], "gateway_inflight": w["inflight"]} for w in rows}
    doc = {
        "soak": soak.__dict__, "pids": pids, "box_memory_mib": psutil.virtual_memory().total >> 20,
        "requests_measured": len(measured), "completed_measured": len(ok),
        "req_s": round(len(ok) / soak.seconds, 1),
        "tokens_measured": sum(r.tokens for r in ok),
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "status_counts": {str(k): v for k, v in status.items()}, "errors": dict(errors),
        "memory": memory, "drain_after_window_s": round(drain_s, 1),
        "seconds_until_no_slot_held": None if to_idle is None else round(to_idle, 2), "after": leaked,
        "rss_series": {k: v for k, v in series.items()},
    }
    doc["failures"] = verdict(doc)
    return doc


def prompt_cache_mib(pid: int) -> int | None:
    """The RAM prompt cache's size limit a llama-server runs with (its last --cache-ram, else llama.cpp's default
    8,192 MiB); None for none (0) or no size limit (-1), where only the 10% rule can judge its growth."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    given = setting([a for a in argv[1:] if a], "--cache-ram")
    value = int(given[0]) if given else LLAMA_CACHE_RAM_MIB
    return value if value > 0 else None


def verdict(doc: dict) -> list[str]:
    """What fails the soak (empty list: it passed). A llama-server may grow by its RAM prompt cache's limit (a
    bounded cache filling with distinct prompts), anything else by less than 10%."""
    out = []
    if doc["errors"]:
        out.append(f"errors other than 429: {doc['errors']}")
    for name, m in doc["memory"].items():
        cache = m.get("prompt_cache_mib")
        if cache and m["growth"] is not None:
            if m["rss_end_mib"] - m["rss_start_mib"] > cache + MAX_RSS_GROWTH * m["rss_start_mib"]:
                out.append(f"{name} RSS grew {m['rss_end_mib'] - m['rss_start_mib']:.0f} MiB over the window, more "
                           f"than its prompt cache's {cache} MiB and 10%")
        elif m["growth"] is None or m["growth"] >= MAX_RSS_GROWTH:
            out.append(f"{name} RSS grew {m['growth']:.1%} over the window (limit {MAX_RSS_GROWTH:.0%})")
    caches = sum(m.get("prompt_cache_mib") or 0 for m in doc["memory"].values())
    if caches > doc["box_memory_mib"] / 2:
        out.append(f"the llama-servers' prompt caches may take {caches} MiB together, over half of the box's "
                   f"{doc['box_memory_mib']} MiB")
    if doc["seconds_until_no_slot_held"] is None:
        out.append(f"slots or streams still held after the run: {doc['after']}")
    if not doc["completed_measured"]:
        out.append("no request completed in the measured window")
    return out


def markdown(doc: dict) -> str:
    s = doc["soak"]
    pace = (f"at {s['tokens_per_s']} tokens/s/stream" if s["backend"] == "loadtest" else
            f"at most ({s['backend']}, chat / story / code edit / JSON schema / Anthropic message in turn, the SDKs' "
            f"default sampling)")
    lines = [f"{s['streams']} streams x {s['seconds']:.0f} s (warm-up {s['warmup_s']:.0f} s discarded), "
             f"{s['tokens']} tokens/request {pace}",
             "", "| figure | value |", "| --- | --- |",
             f"| requests completed (measured window) | {doc['completed_measured']} ({doc['req_s']} req/s) |",
             f"| tokens streamed (measured window) | {doc['tokens_measured']} |",
             f"| TTFT p50 / p99 | {_ms(doc['ttft_ms']['p50'])} / {_ms(doc['ttft_ms']['p99'])} |",
             f"| status counts (whole run) | {doc['status_counts']} |",
             f"| errors other than 429 | {doc['errors'] or 0} |"]
    for name, m in doc["memory"].items():
        cache = f"; prompt cache limit {m['prompt_cache_mib']} MiB" if m.get("prompt_cache_mib") else ""
        lines.append(f"| RSS {name} start -> end (peak) | {m['rss_start_mib']} -> {m['rss_end_mib']} MiB "
                     f"({m['rss_peak_mib']}), {m['growth']:+.1%}{cache} |")
    if "gateway_views" in doc:
        lines.append(f"| samples of the gateway's view with a worker not routable | "
                     f"{sum(doc['not_routable_samples'].values())} of {doc['gateway_views']} |")
    lines.append(f"| slots held afterwards | {doc['after']} (idle after {doc['seconds_until_no_slot_held']} s) |")
    lines.append(f"| verdict | {'PASS' if not doc['failures'] else 'FAIL: ' + '; '.join(doc['failures'])} |")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


# ---- a worker killed under N streams: how many streams are lost (request migration, gateway/migration.py) ----

KILL_PROMPTS = ["Tell me a long story about a lighthouse.", "Explain how a bicycle works, step by step.",
                "Write a letter to a friend about the sea.", "Describe a busy market in the morning."]


def kill_config(streams: int, backend: str) -> str:
    # each worker can hold every stream (the survivor takes them all)
    if backend == "loadtest":
        engine = f"loadtest: {{tokens: 100000, tokens_per_s: 20, slots: {2 * streams}}}"
    elif backend == "llama-server":  # one thread each: two workers share the box's cores
        engine = (f"llama_server: {{slots: {streams}, kv_tokens: {max(2048, 256 * streams)}, threads: 1, "
                  f"headers_timeout_s: 20, stop_grace_s: 3}}")
    else:  # the real engine on the CPU
        engine = f"engine: {{device: cpu, kv_blocks: {max(512, 8 * streams)}, max_num_seqs: {streams}}}"
    return f"""
model: {{name: gemma-3-270m}}  # one model (a config naming none serves both bundled ones)
workers:
  backend: {backend}
  count: 2
  {engine}
server:
  drain_grace_s: 2
"""


def kill_bodies(streams: int, tokens: int) -> list[dict]:
    """Greedy streams of exactly `tokens` tokens (ignore_eos), over a few prompts."""
    return [{"model": MODEL, "messages": [{"role": "user", "content": KILL_PROMPTS[i % len(KILL_PROMPTS)]}],
             "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True}} for i in range(streams)]


async def _migrations(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("pulse_stream_migrations_total{"):
            out[line.split('outcome="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


async def drive_kill(base: str, streams: int, tokens: int, repeats: int, progress: bool = False,
                     child: str | None = None, control: bool = False) -> dict:
    """An undisturbed reference run of the streams, then `repeats` runs that SIGKILL one worker of two (with
    `child`: that worker's child process of that name) once every stream has 4 events. Lost: a stream that
    did not end whole (200, finish reason, [DONE], no error event). Differing: a whole stream whose text is
    not the reference's (greedy: it should be the same). With `control`, each kill run follows an undisturbed
    repeat of the streams, whose texts are compared with the reference too: a backend whose greedy output
    depends on the batch it ran in (llama.cpp) differs there without any kill."""
    raise_fd_limit(4 * streams + 256)
    bodies = kill_bodies(streams, tokens)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        reference = await asyncio.gather(*(stream_chat(s, base, b, timeout_s=600) for b in bodies))
        broken = [i for i, x in enumerate(reference) if not x.complete]
        if broken:
            raise RuntimeError(f"the undisturbed reference run lost streams {broken}: {reference[broken[0]]}")
        runs = []
        for r in range(repeats):
            if await wait_until(lambda: both_serving(s, base, child), 180, 0.5) is None:
                raise RuntimeError("the killed worker did not come back within 180 s")
            calm = None
            if control:  # the same streams undisturbed again: how many texts differ without any kill
                again = await asyncio.gather(*(stream_chat(s, base, b, timeout_s=600) for b in bodies))
                calm = sum(x.complete and x.text != reference[i].text for i, x in enumerate(again))
            before = await _migrations(s, base)
            t0 = time.monotonic()
            seen, info = await kill_under_streams(s, base, bodies, after_events=4, timeout_s=600, child=child)
            after = await _migrations(s, base)
            lost = [i for i, x in enumerate(seen) if not x.complete]
            differ = [i for i, x in enumerate(seen) if x.complete and x.text != reference[i].text]
            moved = {i for i, x in enumerate(seen) if x.worker == info["victim"]}
            short = [i for i, x in enumerate(seen) if x.complete and (x.usage or {}).get("completion_tokens") != tokens]
            run = {"victim": info["victim"], "others_died": info["others_died"],
                   "live_on_victim_at_kill": info["live_on_victim"],
                   "live_elsewhere_at_kill": info["live_elsewhere"], "lost": len(lost),
                   "differing_text": len(differ), "differing_moved": len(moved.intersection(differ)),
                   "differing_undisturbed_repeat": calm,
                   "wrong_usage": len(short),
                   # where each differing text leaves the reference: (stream, moved, chars relayed at the kill,
                   # chars equal to the reference's, reference chars)
                   "differ_at": [(i, i in moved, info["chars_at_kill"][i], _common(seen[i].text, reference[i].text),
                                  len(reference[i].text)) for i in differ][:8],
                   "diverged_before_kill": sum(_common(seen[i].text, reference[i].text) < info["chars_at_kill"][i]
                                               for i in differ),
                   "differing_texts": {i: seen[i].text for i in differ[:8]},
                   "migrations": {k: after.get(k, 0) - before.get(k, 0) for k in ("resumed", "failed")},
                   "seconds": round(time.monotonic() - t0, 1),
                   "lost_saw": [(x.status, x.error_events[:1], x.exception) for x in (seen[i] for i in lost)][:3]}
            runs.append(run)
            if progress:
                print(f"  run {r + 1}/{repeats}: {run}", file=sys.stderr, flush=True)
    return {"streams": streams, "tokens": tokens, "repeats": repeats, "killed": child or "worker", "runs": runs,
            "reference_texts": [x.text for x in reference],
            # streams of the same prompt in the reference whose texts differ from that prompt's first stream
            "reference_self_disagreements": sum(x.text != reference[i % len(KILL_PROMPTS)].text
                                                for i, x in enumerate(reference)),
            "lost_per_run": [x["lost"] for x in runs], "differing_per_run": [x["differing_text"] for x in runs],
            "failures": [f"run {i + 1} lost {x['lost']} streams" + (
                f" (but {', '.join(x['others_died'])} died too: not a one-worker kill)" if x["others_died"] else "")
                for i, x in enumerate(runs) if x["lost"]]}


def _common(a: str, b: str) -> int:
    """Length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kill_markdown(doc: dict) -> str:
    what = "one worker" if doc["killed"] == "worker" else f"one worker's {doc['killed']} process"
    lines = [(f"{doc['streams']} greedy streams x {doc['tokens']} tokens, 2 workers ({doc['backend']}), {what} "
              f"SIGKILLed mid-run, {doc['repeats']} runs"), "",
             ("| run | streams on the killed worker / elsewhere | lost | text differs from the reference (of them "
              "moved; in the undisturbed repeat) | wrong usage | migrations resumed / failed | seconds |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(doc["runs"]):
        also = f" (also died: {', '.join(r['others_died'])})" if r["others_died"] else ""
        calm = "" if r["differing_undisturbed_repeat"] is None else f"; {r['differing_undisturbed_repeat']} undisturbed"
        lines.append(f"| {i + 1} | {r['live_on_victim_at_kill']} / {r['live_elsewhere_at_kill']}{also} | {r['lost']} | "
                     f"{r['differing_text']} ({r['differing_moved']}){calm} | {r['wrong_usage']} | "
                     f"{r['migrations']['resumed']:.0f} / {r['migrations']['failed']:.0f} | {r['seconds']} |")
    lines.append(f"\nreference run: {doc['reference_self_disagreements']} of {doc['streams']} streams differ from the "
                 f"first stream of the same prompt")
    return "\n".join(lines)


def start_serve(out, kind: str, config_text: str):
    """`pulse serve` on a free port with `config_text` (written as reliability-KIND-STAMP.yaml, logs in
    logs-reliability-KIND-STAMP): (stamp, port, its Proc, the machine before it started)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / f"reliability-{kind}-{stamp}.yaml"
    cfg.write_text(config_text)
    port = free_port()
    before = machine_info()
    proc = Proc("pulse-serve", python_module("pulse.cli", "serve", "--port", str(port), "--config", str(cfg)),
                out / f"logs-reliability-{kind}-{stamp}")
    return stamp, port, proc, before


def run_kill(args: argparse.Namespace) -> int:
    child = None if args.kill == "worker" else args.kill
    if child and args.backend != child:
        raise SystemExit(f"--kill {child} needs --backend {child}")
    stamp, port, proc, before = start_serve(args.out, "kill", kill_config(args.streams, args.backend))
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", 300)
        doc = asyncio.run(drive_kill(f"http://127.0.0.1:{port}", args.streams, args.tokens, args.repeats,
                                     not args.quiet, child, args.control))
    finally:
        left = proc.stop()
    doc.update(backend=args.backend, command=command_line(), machine=before, loadavg_end=list(os.getloadavg()),
               server_leftovers=left)
    path = args.out / f"reliability-kill-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(kill_markdown(doc))
    print(f"\nload average at start {before['loadavg']}, at end {doc['loadavg_end']}; result: {path}")
    return 0 if not doc["failures"] else 1


def run_cli(args: argparse.Namespace) -> int:
    soak = Soak(args.streams, args.seconds, args.warmup, args.tokens, args.tokens_per_s, args.backend)
    stamp, port, proc, before = start_serve(args.out, "load", server_config(soak))
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", 240 if soak.backend == "loadtest" else 600)
        doc = loops.run(drive(f"http://127.0.0.1:{port}", soak, progress=not args.quiet), args.loop)
    finally:
        left = proc.stop()
    doc.update(command=command_line(), machine=before, loadavg_end=list(os.getloadavg()),
               server_leftovers=left, loop=args.loop)
    if left:
        doc["failures"].append(f"processes needed SIGKILL at stop: {left}")
    path = args.out / f"reliability-load-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(markdown(doc))
    print(f"\nload average at start {before['loadavg']}, at end {doc['loadavg_end']}; result: {path}")
    return 0 if not doc["failures"] else 1


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("load", help="N concurrent streams for T seconds; memory, errors, leaks")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=60.0, help="measured window")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the window (discarded)")
    p.add_argument("--tokens", type=int, default=Soak.tokens, help="tokens per request")
    p.add_argument("--tokens-per-s", type=float, default=Soak.tokens_per_s, help="per stream (load-test backend)")
    p.add_argument("--backend", choices=["loadtest", "llama-server", "cupy"], default="loadtest",
                   help="the load-test instrument, or a real model as `pulse serve` ships it")
    p.add_argument("--loop", choices=loops.CHOICES, default="auto")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--quiet", action="store_true")
    k = sub.add_parser("kill", help="N streams, one worker of two SIGKILLed mid-run: streams lost")
    k.add_argument("--streams", type=int, default=32)
    k.add_argument("--tokens", type=int, default=32, help="tokens per stream (greedy, ignore_eos)")
    k.add_argument("--repeats", type=int, default=3, help="kill runs (after one undisturbed reference run)")
    k.add_argument("--backend", choices=["cupy", "llama-server", "loadtest"], default="cupy")
    k.add_argument("--kill", choices=["worker", "llama-server"], default="worker",
                   help="what to SIGKILL: the worker actor, or its llama-server child (--backend llama-server)")
    k.add_argument("--control", action="store_true",
                   help="before each kill run, repeat the streams undisturbed and count texts that differ there")
    k.add_argument("--out", type=Path, default=OUT)
    k.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    return run_kill(args) if args.cmd == "kill" else run_cli(args)


if __name__ == "__main__":
    sys.exit(main())
