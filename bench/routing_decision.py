"""The routing decision alone, on this machine's CPU: an agent trace's prompts through the gateway's own
PrefixRouter (session block hashes, the in-process index, the policy), no servers and no model.

The trace is bench/routing.py's (same arguments and defaults as its H200 replay); its prompts are sent
turn by turn, every session's turn t before any turn t+1, to 4 workers on one device, and after each
decision the chosen worker is recorded as holding the prompt (as the gateway's dispatcher does). What
bench/routing.py reads from a live gateway's histograms, here per decision: the CPU time of the decision
on this thread (what `pulse_router_decision_cpu_seconds` counts: hashing the new blocks, worker loads,
the policy; not the index lookup) and its wall time (the lookup included). Configurations, interleaved
per bench/protocol.py, each one replay of the whole trace with a fresh router and index:
- xxh3:    the block hash as it is (cache/hashing.py: XXH3-64 seeded by the parent);
- blake2b: the hash Pulse used before (blake2b over the parent's 8 bytes and the block's ids), over the
           same packed ids: what the hash formula alone changed.

    python -m bench.routing_decision --repeats 5 --warmup 1                    # the 14-turn trace
    python -m bench.routing_decision --turns 10 --tool-words 300 900 --kv-blocks 1536
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import struct
import time
from contextlib import contextmanager

import numpy as np

import gateway.router as router_mod
from bench.machine import machine_info
from bench.protocol import schedule, summarize
from bench.routing import TraceSpec, build_trace, prompt_builder
from cache.memory_index import MemoryPrefixIndex
from gateway.pool import WorkerState
from gateway.router import PrefixRouter
from policy.config import RoutingConfig
from workers.protocol import BackendStats, GenerateRequest, WorkerInfo

CONFIGS = ("xxh3", "blake2b")
_PARENT = struct.Struct("<q")


def blake2b_chain_packed(raw: bytes, block_size: int, parent: int = 0) -> list[int]:
    """The block hash chain as it was before XXH3 (for this comparison only)."""
    step, pack, out = 4 * block_size, _PARENT.pack, []
    for start in range(0, len(raw) - step + 1, step):
        parent = int.from_bytes(hashlib.blake2b(pack(parent) + raw[start:start + step], digest_size=8).digest(),
                                "little") >> 1
        out.append(parent)
    return out


@contextmanager
def hashing(config: str):
    if config == "xxh3":
        yield
        return
    saved = router_mod.chain_hashes_packed
    router_mod.chain_hashes_packed = blake2b_chain_packed
    try:
        yield
    finally:
        router_mod.chain_hashes_packed = saved


def workers(n: int, kv_blocks: int, slots: int) -> list[WorkerState]:
    return [WorkerState(WorkerInfo(f"w{i}", "http://127.0.0.1:1", "cupy", node_id="n", device_id="gpu-0",
                                   block_size=16),
                        BackendStats(slots=slots, kv_blocks_total=kv_blocks, block_size=16)) for i in range(n)]


async def replay(prompts: list[tuple[str, list[int]]], args) -> dict:
    index = MemoryPrefixIndex()
    router = PrefixRouter(index, RoutingConfig())
    ws = workers(args.workers, args.kv_blocks, args.max_num_seqs)
    cpu, wall = [], []
    for session, ids in prompts:
        gen = GenerateRequest(request_id="r", prompt_ids=ids, max_tokens=4, session_id=session)
        t0 = time.perf_counter()
        result = await router.choose(ws, gen)
        wall.append(time.perf_counter() - t0)
        cpu.append(result.cpu_s)
        await index.publish(result.worker.worker_id, result.hashes)
    cpu_ms, wall_ms = 1e3 * np.array(cpu), 1e3 * np.array(wall)
    return {"cpu_p50_ms": float(np.median(cpu_ms)), "cpu_p99_ms": float(np.percentile(cpu_ms, 99)),
            "cpu_max_ms": float(cpu_ms.max()), "cpu_over_1ms": float((cpu_ms > 1.0).mean()),
            "wall_p99_ms": float(np.percentile(wall_ms, 99))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=14)
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--tool-words", type=int, nargs=2, default=(500, 1100))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=3000)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled model)")
    args = ap.parse_args(argv)
    encode = prompt_builder(args.model)
    spec = TraceSpec(sessions=args.sessions, turns=args.turns, system_words=args.system_words,
                     tool_words=tuple(args.tool_words))
    records = []
    for i, s in enumerate(schedule(CONFIGS, args.repeats, args.warmup)):
        trace = build_trace(spec, f"run{i}")  # a fresh salt: no run reuses another's blocks
        prompts = [(f"s{k}", encode(trace[k][t][1])) for t in range(spec.turns) for k in range(spec.sessions)]
        time.sleep(0.2)  # the tokenizer's worker threads go idle before the timed replay
        with hashing(s.config):
            metrics = asyncio.run(replay(prompts, args))
        records.append({"phase": s.phase, "config": s.config, "metrics": metrics})
    summary = summarize(records)
    lengths = [len(ids) for _, ids in prompts]
    m = machine_info()
    print(f"{len(prompts)} decisions a run, prompts {min(lengths)}-{max(lengths)} tokens; {m['cpu']}, "
          f"{m['cores']} cores; load {os.getloadavg()[0]:.2f}")
    names = list(records[-1]["metrics"])
    print("| config | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for config in CONFIGS:
        cells = [f"{summary[config][k]['median']:.3f} ({summary[config][k]['min']:.3f}–{summary[config][k]['max']:.3f})"
                 for k in names]
        print(f"| {config} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
