"""Routing comparison (issue 6): one synthetic agent trace replayed against Pulse's router and three baselines.

One `pulse serve --workers N` per strategy (routing.strategy = pulse | round_robin | least_loaded |
session_sticky), all started up front (their workers share the memory-mapped weights), real engine workers
with small KV budgets so caches evict. Per repeat every strategy replays the trace once, interleaved and
rotated per the protocol; warm-up repeats are discarded.

The trace: `sessions` agent sessions run concurrently, each `turns` turns in order (`x-session-id` set,
a think time before each turn); every prompt starts with one shared system prompt; each turn appends a user
message carrying a tool result (a file read, a test log: 60-140 words, most of a turn's new tokens), the
assistant's previous message stays in the history (a fixed synthetic text, so the trace is the same for
every strategy whatever the model answers); now and then a turn edits a message in the middle of the
history (everything after it changes). Short answers (max_tokens 4, temperature 0). Every run gets its
own salt at the head of the system prompt, so no run is served from an earlier run's cache.

Per run: TTFT p50/p99 (first streamed content); prefix hit rate = sum cached_tokens / sum prompt_tokens (from
usage); the oracle's hit rate (see `oracle_hits`) and hit/oracle; prompt tokens left to compute per request,
this strategy's and the oracle's (round-robin's over the oracle's bounds what any router can gain in prefill
work); load = requests per worker (x-pulse-worker) max over mean; router decision p99 from the gateway's
pulse_router_decision_seconds histogram (wall time of the route step, interpolated within its bucket) and
the share of decisions <= 1 ms (exact: 1 ms is a bucket bound); the p99 of pulse_router_decision_cpu_seconds
(the decision's own CPU time on the gateway thread, without the time the thread was preempted); goodput =
successful requests/s; rejections = 429 + 503 answers; the 1-minute load average at the end of the run.
Per request (JSON `requests_trace`): send time, worker, prompt / cached / oracle tokens, TTFT, and the
requests still waiting for their first token at the same worker when it was sent (what it queued behind).

    python -m bench.routing --repeats 5 --warmup 1

Memory: each `pulse serve` is its own Ray instance (~1.5 GB). The CPU engine workers share the weights:
the dequantized tensors and the packed layer matrices are memory-mapped from ~/.cache/pulse (one copy in the
page cache for every worker on the box). What a CPU worker holds privately (~680 MB measured) is mostly its
tokenizer (~280 MB) and the grammar vocabulary index (~310 MB). Before the packed matrices were cached each
worker also held ~475 MB of private weight copies, and four servers of four workers ran the 24 GiB box out
of memory.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import msgspec
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import loops, protocol
from bench.loadgen import event_content
from bench.machine import checked_machine_info, describe
from bench.procs import Proc, free_port, owned_processes, python_module, stop_all
from cache.hashing import ROOT_HASH, block_hash

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = ["pulse", "round_robin", "least_loaded", "session_sticky"]
GOAL_TTFT_X, GOAL_HIT_VS_ORACLE, GOAL_LOAD, GOAL_DECISION_MS = 3.0, 0.9, 1.5, 1.0
TABLE_METRICS = ["ttft_p50_ms", "ttft_p99_ms", "rr_ttft_p50_over", "hit_rate", "oracle_hit_rate", "hit_vs_oracle",
                 "uncached_per_req", "oracle_uncached_per_req",
                 "load_max_over_mean", "decision_p99_ms", "decisions_le_1ms", "decision_cpu_p99_ms", "goodput_req_s",
                 "rejections", "errors", "load_1m"]
PLOT_METRICS = ["ttft_p50_ms", "hit_vs_oracle", "load_max_over_mean", "goodput_req_s"]
WORDS = ("def class return import self value config worker request cache block token prefix route load queue "
         "session prompt test assert error retry stream buffer index redis engine schedule batch decode prefill "
         "latency budget policy score hash chain evict metric span trace gateway replica server client file "
         "patch diff line function module package build run check fix update refactor parse render").split()


# ---- the trace ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceSpec:
    sessions: int = 8
    turns: int = 5
    system_words: int = 180  # the shared system prompt (~1.3 tokens a word)
    user_words: tuple[int, int] = (14, 28)
    tool_words: tuple[int, int] = (60, 140)  # each turn carries a tool result (a file read, a test run)
    answer_words: tuple[int, int] = (8, 16)
    edit_prob: float = 0.2  # chance a turn (from the 3rd on) rewrites a message in the middle of the history
    think_s: tuple[float, float] = (0.3, 1.0)
    seed: int = 1
    session_ids: bool = True  # False: clients that send no x-session-id (sticky routing then has nothing to go on)


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def _user(rng: random.Random, spec: TraceSpec, head: str) -> dict:
    """An agent turn: a short instruction plus the tool output the agent read (file, diff, test log). The tool
    output is what makes an agent's context grow: it is most of each turn's new tokens."""
    text = f"{head} " + _text(rng, rng.randint(*spec.user_words))
    if spec.tool_words[1] > 0:
        text += "\n<tool_result>\n" + _text(rng, rng.randint(*spec.tool_words)) + "\n</tool_result>"
    return {"role": "user", "content": text}


def build_trace(spec: TraceSpec, salt: str) -> list[list[tuple[float, list[dict]]]]:
    """Per session, its turns in order as (think seconds, messages). Same seed: same words, whatever the salt."""
    rng = random.Random(spec.seed)
    system = {"role": "system", "content": f"[{salt}] You are a coding agent. " + _text(rng, spec.system_words)}
    sessions = []
    for s in range(spec.sessions):
        history: list[dict] = []
        turns = []
        for t in range(spec.turns):
            users = [i for i, m in enumerate(history) if m["role"] == "user"]
            if t >= 2 and rng.random() < spec.edit_prob:
                j = users[len(users) // 2]  # a message in the middle: the agent rewrote what it showed there
                history[j] = _user(rng, spec, f"(edited) session {s}:")
            history.append(_user(rng, spec, f"session {s} turn {t}:"))
            turns.append((rng.uniform(*spec.think_s), [system, *history]))
            history = history + [{"role": "assistant", "content": _text(rng, rng.randint(*spec.answer_words))}]
        sessions.append(turns)
    return sessions


def oracle_hits(prompts: Sequence[Sequence[int]], block: int, capacity_blocks: int) -> list[int]:
    """Cached tokens an oracle gets per prompt, prompts in the order they were sent.

    The oracle is one LRU cache of `capacity_blocks` (all workers' KV budgets pooled) holding the full blocks
    of every earlier prompt of this run; a prompt's hit is its longest run of leading blocks in that cache,
    leaving at least one token to compute (as the engine does). Blocks of generated tokens are not counted.
    """
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for ids in prompts:
        hashes, parent = [], ROOT_HASH
        for i in range(len(ids) // block):
            parent = block_hash(parent, tuple(ids[i * block:(i + 1) * block]))
            hashes.append(parent)
        usable = hashes[:(len(ids) - 1) // block]
        hit = next((i for i, h in enumerate(usable) if h not in cache), len(usable))
        out.append(hit * block)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return out


def prompt_builder(model: str | None = None):
    """The gateway's own templating and tokenizer (gateway/ingress.py), so token counts match the server's."""
    from gateway.openai_types import Message
    from gateway.prompt import PromptBuilder
    from workers.protocol.model import load_model_info, load_tokenizer

    info = load_model_info(model)
    builder = PromptBuilder(load_tokenizer(model), architecture=info.architecture, bos_token_id=info.bos_token_id,
                            add_bos=info.add_bos, template=info.chat_template)
    return lambda msgs: builder.chat([Message(role=m["role"], content=m["content"]) for m in msgs]).ids


# ---- one replay --------------------------------------------------------------------------------------------

async def send(session: aiohttp.ClientSession, base: str, model: str, messages: list[dict], sid: str | None,
               max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    rec = {"sent": time.perf_counter(), "status": 0, "ttft": None, "worker": None, "prompt": 0, "cached": 0,
           "error": None, "messages": messages}
    try:
        headers = {"x-session-id": sid} if sid is not None else {}
        async with session.post(base + "/v1/chat/completions", json=body, headers=headers) as resp:
            rec["status"], rec["worker"] = resp.status, resp.headers.get("x-pulse-worker")
            if resp.status != 200:
                await resp.read()
                return rec
            async for line in resp.content:
                if not line.startswith(b"data:") or (data := line[5:].strip()) == b"[DONE]":
                    continue
                event = msgspec.json.decode(data)
                if "error" in event:
                    rec["error"] = "stream_error"
                text, _ = event_content(event)
                if text and rec["ttft"] is None:
                    rec["ttft"] = time.perf_counter() - rec["sent"]
                if usage := event.get("usage"):
                    rec["prompt"] = usage["prompt_tokens"]
                    rec["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
        rec["error"] = type(exc).__name__
    if rec["ttft"] is None and rec["error"] is None:
        rec["error"] = "no_content"
    return rec


async def replay(base: str, model: str, trace, salt: str, max_tokens: int, timeout: float,
                 session_ids: bool = True) -> tuple[list[dict], float]:
    records: list[dict] = []

    async def one_session(i: int, turns) -> None:
        for think, msgs in turns:  # turns in order: an agent waits for its answer, thinks, sends the next
            await asyncio.sleep(think)
            sid = f"{salt}-s{i}" if session_ids else None
            records.append(await send(http, base, model, msgs, sid, max_tokens))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(one_session(i, t) for i, t in enumerate(trace)))
        return records, time.perf_counter() - start


# ---- the gateway's own figures -----------------------------------------------------------------------------

DECISION_WALL, DECISION_CPU = "pulse_router_decision_seconds", "pulse_router_decision_cpu_seconds"


async def decision_buckets(base: str) -> dict[str, dict[float, float]]:
    """Per histogram (decision wall time, decision CPU time): {le: cumulative count}, summed over replicas."""
    async with aiohttp.ClientSession() as http, http.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, dict[float, float]] = {DECISION_WALL: {}, DECISION_CPU: {}}
    for fam in text_string_to_metric_families(text):
        if fam.name in out:
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    out[fam.name][le] = out[fam.name].get(le, 0.0) + s.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float],
                    q: float) -> tuple[float | None, float | None]:
    """(q-quantile in seconds, share <= 1 ms) of the decisions made between two scrapes.

    The quantile is interpolated linearly inside its bucket, as Prometheus' histogram_quantile does.
    """
    bounds = sorted(after)
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    total = cum[-1] if cum else 0.0
    if total <= 0:
        return None, None
    share = next((c for b, c in zip(bounds, cum) if b >= 1e-3), total) / total
    rank, lo, prev = q * total, 0.0, 0.0
    for b, c in zip(bounds, cum):
        if c >= rank:
            if b == float("inf"):
                return lo, share  # past the last finite bound: report that bound (a lower bound)
            return lo + (b - lo) * ((rank - prev) / (c - prev) if c > prev else 1.0), share
        lo, prev = b, c
    return None, share


# ---- one measured run --------------------------------------------------------------------------------------

def run_metrics(recs: list[dict], wall: float, workers: list[str], oracle: list[int], decision) -> dict:
    good = [r["status"] == 200 and r["error"] is None for r in recs]
    ok = [r for r, g in zip(recs, good) if g]
    ttft = [r["ttft"] for r in ok]
    per_worker = Counter(r["worker"] for r in ok)
    loads = [per_worker.get(w, 0) for w in workers]
    prompt = sum(r["prompt"] for r in ok)
    hit = sum(r["cached"] for r in ok) / prompt if prompt else None
    oracle_rate = sum(o for o, g in zip(oracle, good) if g) / sum(len(r["ids"]) for r in ok) if ok else None
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else None
    return {
        "ttft_p50_ms": statistics.median(ttft) * 1000 if ttft else None,
        "ttft_p99_ms": q[98] * 1000 if q else None,
        "hit_rate": hit,
        "uncached_per_req": (prompt - sum(r["cached"] for r in ok)) / len(ok) if ok else None,
        "oracle_uncached_per_req": sum(len(r["ids"]) - o for r, o, g in zip(recs, oracle, good) if g) / len(ok)
        if ok else None,
        "oracle_hit_rate": oracle_rate,
        "hit_vs_oracle": hit / oracle_rate if hit is not None and oracle_rate else None,
        "load_max_over_mean": max(loads) / statistics.mean(loads) if sum(loads) else None,
        "decision_p99_ms": decision[0] * 1000 if decision[0] is not None else None,
        "decisions_le_1ms": decision[1],
        "goodput_req_s": len(ok) / wall,
        "rejections": sum(r["status"] in (429, 503) for r in recs),
        "errors": sum(r["status"] not in (200, 429, 503) or r["error"] is not None for r in recs),
        "requests": len(recs),
    }


def make_measure(args, target: dict, counter, encode):
    async def measure() -> dict:
        salt = f"run {next(counter):03d}"
        trace = build_trace(args.trace, salt)
        before = await decision_buckets(target["base"])
        recs, wall = await replay(target["base"], target["model"], trace, salt, args.max_tokens, args.timeout,
                                  args.trace.session_ids)
        after = await decision_buckets(target["base"])
        decision = bucket_quantile(before[DECISION_WALL], after[DECISION_WALL], 0.99)
        cpu_p99, cpu_le_1ms = bucket_quantile(before[DECISION_CPU], after[DECISION_CPU], 0.99)
        recs.sort(key=lambda r: r["sent"])
        for r in recs:
            r["ids"] = encode(r.pop("messages"))
        oracle = oracle_hits([r["ids"] for r in recs], args.block_size, args.kv_blocks * args.workers)
        mismatched = sum(r["status"] == 200 and r["prompt"] != len(r["ids"]) for r in recs)
        detail = {"per_worker": dict(Counter(r["worker"] for r in recs)),
                  "statuses": dict(Counter(r["status"] for r in recs)), "prompt_token_mismatches": mismatched,
                  "wall_s": wall, "requests_trace": request_trace(recs, oracle),
                  "cached": [r["cached"] for r in recs], "oracle": oracle, "prompt": [len(r["ids"]) for r in recs]}
        metrics = run_metrics(recs, wall, target["workers"], oracle, decision) | {
            "decision_cpu_p99_ms": cpu_p99 * 1000 if cpu_p99 is not None else None,
            "decision_cpu_le_1ms": cpu_le_1ms, "load_1m": os.getloadavg()[0]}
        return {"metrics": metrics, **detail}
    return measure


def request_trace(recs: list[dict], oracle: list[int]) -> list[dict]:
    """Per request (in send order): when sent (s from the first), worker, prompt / cached / oracle tokens, TTFT,
    and what it queued behind: requests sent earlier to the same worker (and to any worker) that had not yet
    produced their first token when it was sent (their prefill was ahead of it, or running beside it)."""
    t0 = recs[0]["sent"] if recs else 0.0
    first = [r["sent"] + r["ttft"] if r["ttft"] is not None else float("inf") for r in recs]
    out = []
    for i, r in enumerate(recs):
        ahead = [j for j in range(i) if first[j] > r["sent"]]
        out.append({"t": round(r["sent"] - t0, 3), "worker": r["worker"], "status": r["status"],
                    "prompt": len(r["ids"]), "cached": r["cached"], "oracle": oracle[i],
                    "ttft_ms": round(r["ttft"] * 1000, 1) if r["ttft"] is not None else None,
                    "ahead_same_worker": sum(recs[j]["worker"] == r["worker"] for j in ahead),
                    "ahead_uncached_same_worker": sum(len(recs[j]["ids"]) - recs[j]["cached"] for j in ahead
                                                      if recs[j]["worker"] == r["worker"]),
                    "ahead_any_worker": len(ahead)})
    return out


# ---- servers -----------------------------------------------------------------------------------------------

def server_config(args, strategy: str, port: int, log_dir: Path) -> Path:
    cfg = {
        "server": {"port": port},
        "workers": {"backend": "cupy", "count": args.workers,
                    "engine": {"device": args.device, "max_num_seqs": args.max_num_seqs, "kv_blocks": args.kv_blocks,
                               "block_size": args.block_size, "speculation": False}},
        "routing": {"strategy": strategy},
        "keys": {"file": str(log_dir / f"keys-{strategy}.json")},  # open on loopback: no key store of the user's
        "telemetry": {"log_level": "WARNING"},
    }
    cfg["model"] = {"path": args.model}  # one model (a config naming none serves both bundled ones)
    path = log_dir / f"pulse-{strategy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(args, strategy: str, log_dir: Path, name: str | None = None) -> tuple[Proc, str]:
    """Start one `pulse serve` for `strategy`; returns the process and its base URL (not yet healthy)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    port = free_port()
    cfg = server_config(args, strategy, port, log_dir)
    proc = Proc(name or strategy, python_module("pulse.cli", "serve", "--config", str(cfg)), log_dir, env)
    return proc, f"http://127.0.0.1:{port}"


def target_of(args, strategy: str, proc: Proc, base: str) -> dict:
    """Wait until the server answers; its model id and worker ids."""
    proc.wait_healthy(base + "/health", timeout=args.start_timeout)
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    with urllib.request.urlopen(base + "/pulse/workers", timeout=10) as r:
        workers = sorted(w["worker_id"] for w in json.load(r)["workers"])
    if len(workers) != args.workers:
        raise RuntimeError(f"{strategy}: {len(workers)} workers, expected {args.workers}")
    return {"base": base, "model": model, "workers": workers}


def start_servers(args, log_dir: Path, procs: list[Proc]) -> dict[str, dict]:
    bases = {}
    for strategy in args.strategies:
        proc, bases[strategy] = launch(args, strategy, log_dir)
        procs.append(proc)
        time.sleep(args.stagger)  # Ray clusters starting at the same instant contend for the 2 cores
    return {s: target_of(args, s, proc, base) for proc, (s, base) in zip(procs, bases.items())}


def make_cold_measure(args, strategy: str, log_dir: Path, counter, encode, procs: list[Proc], starts: list):
    """--one-at-a-time: every run starts its own server, warms each worker with one short request (not
    counted), replays the trace, and stops the server; so only one server's memory is in use at a time."""
    n = itertools.count()

    async def measure() -> dict:
        t0 = time.perf_counter()
        proc, base = launch(args, strategy, log_dir, f"{strategy}-{next(n)}")
        procs.append(proc)
        try:
            target = await asyncio.to_thread(target_of, args, strategy, proc, base)
            starts.append({"strategy": strategy, "start_s": time.perf_counter() - t0})
            await warm_up(target, args.workers)
            out = await make_measure(args, target, counter, encode)()
            out["start_s"] = starts[-1]["start_s"]
            return out
        finally:
            procs.remove(proc)
            await asyncio.to_thread(stop_all, [proc])

    return measure


async def warm_up(target: dict, n: int) -> None:
    """One short request per worker, at once (every strategy spreads concurrent cache misses with no
    session), so no measured request pays a fresh process's first forward pass."""
    msgs = [[{"role": "user", "content": f"warm-up {i}: say ok"}] for i in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(send(http, target["base"], target["model"], m, "", 2)  # "": no session
                               for i, m in enumerate(msgs)))
    await asyncio.sleep(0.6)  # past one worker poll, so the index holds what they computed


# ---- report ------------------------------------------------------------------------------------------------

def derive(records: Sequence[dict]) -> list[dict]:
    """Round-robin's TTFT p50 over each strategy's, paired within a repeat."""
    out = []
    for repeat, cfgs in protocol.by_repeat(records).items():
        rr = cfgs.get("round_robin", {}).get("ttft_p50_ms")
        for cfg, m in cfgs.items():
            if rr and m.get("ttft_p50_ms"):
                out.append({"phase": "measure", "repeat": repeat, "config": cfg,
                            "metrics": {"rr_ttft_p50_over": rr / m["ttft_p50_ms"]}})
    return out


BASELINES = [s for s in STRATEGIES if s != "pulse"]


def best_baseline(records: Sequence[dict]) -> list[str]:
    """Pulse against the best simple baseline on TTFT p50 (the one a user would otherwise run), paired per
    repeat, with that baseline's TTFT p99, hits and load beside Pulse's."""
    summary = protocol.summarize(records)
    baselines = [b for b in BASELINES if summary.get(b, {}).get("ttft_p50_ms")]
    if "pulse" not in summary or not baselines:
        return []
    best = min(baselines, key=lambda b: summary[b]["ttft_p50_ms"]["median"])
    ratios = [cfgs[best]["ttft_p50_ms"] / cfgs["pulse"]["ttft_p50_ms"]
              for cfgs in protocol.by_repeat(records).values() if best in cfgs and "pulse" in cfgs]
    r = protocol.spread(ratios)
    side = [f"{k} {summary['pulse'][k]['median']:.2f} vs {summary[best][k]['median']:.2f}"
            for k in ("ttft_p99_ms", "hit_vs_oracle", "load_max_over_mean") if k in summary[best]]
    return [f"BEST BASELINE {best}: its TTFT p50 / pulse's, paired per repeat, median {r['median']:.2f} "
            f"({r['min']:.2f}-{r['max']:.2f}); pulse vs {best}: " + ", ".join(side)]


def verdict(summary: dict) -> list[str]:
    s = summary.get("pulse", {})
    lines = []
    for key, goal, better, label in (("rr_ttft_p50_over", GOAL_TTFT_X, ">=", "TTFT p50 round-robin / pulse"),
                                     ("hit_vs_oracle", GOAL_HIT_VS_ORACLE, ">=", "prefix hits / oracle's"),
                                     ("load_max_over_mean", GOAL_LOAD, "<=", "busiest worker's requests / mean"),
                                     ("decision_p99_ms", GOAL_DECISION_MS, "<=", "router decision p99 ms"),
                                     ("decision_cpu_p99_ms", GOAL_DECISION_MS, "<=",
                                      "router decision CPU-time p99 ms")):
        if key not in s:
            lines.append(f"MISS pulse: {label}: not measured")
            continue
        med = s[key]["median"]
        ok = med >= goal if better == ">=" else med <= goal
        lines.append(f"{'MET ' if ok else 'MISS'} pulse: {label} median {med:.3f} "
                     f"({s[key]['min']:.3f}-{s[key]['max']:.3f}; goal {better} {goal:g})")
    return lines


def report(args, records, targets, machine, started) -> None:
    summary = protocol.summarize(records)
    for cfg, ms in protocol.summarize(derive(records)).items():
        summary.setdefault(cfg, {}).update(ms)
    summary = {s: summary[s] for s in args.strategies if s in summary}
    params = {k: v for k, v in vars(args).items() if k != "trace"} | {"trace": asdict(args.trace), "targets": targets}
    doc = protocol.result_document("routing", records, summary, params, started, machine)
    doc["verdict"] = best_baseline(records) + verdict(summary)
    table = protocol.markdown_table(summary, TABLE_METRICS, digits=2)
    paths = protocol.write_result(doc, table, PLOT_METRICS, args.out, notes="\n".join(doc["verdict"]))
    print(f"\n`{doc['command']}`\n\nMachine: {describe(machine)}\n\n{table}\n\n" + "\n".join(doc["verdict"]))
    print("\n" + "\n".join(f"{k}: {v}" for k, v in paths.items()))


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=160,
                    help="KV blocks per worker: about 3 of the trace's final contexts, so caches evict")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=2, help="running sequences per worker")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=TraceSpec.sessions)
    ap.add_argument("--turns", type=int, default=TraceSpec.turns)
    ap.add_argument("--system-words", type=int, default=TraceSpec.system_words)
    ap.add_argument("--tool-words", type=int, nargs=2, default=TraceSpec.tool_words, metavar=("MIN", "MAX"),
                    help="words of tool output each turn adds (an agent's context grows by this)")
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                    help="the engine workers' device (cuda: every server's workers share the box's GPUs)")
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled model)")
    ap.add_argument("--think", type=float, nargs=2, default=TraceSpec.think_s, metavar=("MIN", "MAX"),
                    help="seconds an agent waits before each turn (uniform)")
    ap.add_argument("--edit-prob", type=float, default=TraceSpec.edit_prob)
    ap.add_argument("--seed", type=int, default=TraceSpec.seed)
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--stagger", type=float, default=5.0, help="seconds between starting the servers")
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--no-session-ids", action="store_true",
                    help="clients send no x-session-id (agents that do not), so session-sticky has nothing to use")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="start and stop a server per run (cold, one server's memory at a time) instead of "
                         "keeping one server per strategy up for the whole run")
    protocol.add_arguments(ap, RESULTS)
    args = ap.parse_args(argv)
    args.trace = TraceSpec(sessions=args.sessions, turns=args.turns, system_words=args.system_words,
                           tool_words=tuple(args.tool_words), edit_prob=args.edit_prob, seed=args.seed,
                           think_s=tuple(args.think), session_ids=not args.no_session_ids)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    machine, started = checked_machine_info(), time.time()
    log_dir = args.out / f"logs-routing-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}"
    encode, counter = prompt_builder(args.model), itertools.count()
    with owned_processes() as procs:
        if args.one_at_a_time:
            starts: list = []
            runs = {s: make_cold_measure(args, s, log_dir, counter, encode, procs, starts) for s in args.strategies}
            targets = {"one_at_a_time": starts}
        else:
            targets = start_servers(args, log_dir, procs)
            print(f"servers up after {time.time() - started:.0f} s", file=sys.stderr)
            runs = {s: make_measure(args, targets[s], counter, encode) for s in args.strategies}
        records = loops.run(protocol.run(runs, args.repeats, args.warmup, not args.quiet))
        report(args, records, targets, machine, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
