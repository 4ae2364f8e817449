"""Prefix hits of the sliding-window KV pool on the routing trace: a CPU-only policy replay through the engine's
own block manager and scheduler (workers/cupy/kv_cache.py, scheduler.py), no model compute.

bench/routing.py's agent trace is tokenized with the gateway's templating; sessions are pinned to workers
(session s on worker s % workers, two per worker with 8 sessions over 4: what Pulse and session-sticky routing
do, no session moves). Each worker is one BlockManager + Scheduler planned as the engine plans them
(plan_for with the bundled Gemma 3's layer pattern, the engine's default step budget). Turn t of every
session is queued at once, then each worker steps as Engine.step does (schedule, mark the chunk computed,
commit_full_blocks, sample a token for each sequence whose known tokens are all computed) until its requests
have generated `max_tokens` tokens each. Cached tokens are what the scheduler's first match_prefix gave.

Policies, side by side in one run:
- `old`: the local blocks a sequence attached at its hit point go cold when they slide out (only the window
  behind its own prompt end stays young), and plan_pools caps finished windows at max_num_seqs windows;
- `new`: the current BlockManager and plan_pools (the window behind the hit point stays young too, and
  finished windows get a third of what the running batch leaves, uncapped);
- `old rule, new sizing` and `new rule, old sizing`: each change alone;
- `plain LRU, new sizing`: no cold blocks, every slid-out block young (what the cold rule replaced);
- `oracle`: bench.routing.oracle_hits for the same prompts (one pooled LRU of every worker's budget, full
  blocks, no sliding windows).
Bookkeeping only, deterministic: the figures are exact, not timed, so no repeats.

    python -m bench.window_hits                                     # the 14-turn trace, kv_blocks 3000
    python -m bench.window_hits --turns 10 --tool-words 300 900 --kv-blocks 1536
"""
from __future__ import annotations

import argparse
import json

from bench.routing import TraceSpec, build_trace, oracle_hits, prompt_builder
from workers.cupy.gemma3 import Gemma3Config
from workers.cupy.kv_cache import BlockManager, PoolPlan, plan_for, plan_pools
from workers.cupy.scheduler import Scheduler
from workers.cupy.sequence import Sequence
from workers.protocol.model import load_model_info

GEN_TOKEN = 1  # the generated tokens (ids differ from the trace's fixed answers, as a real model's mostly do)


class LruBlockManager(BlockManager):
    """Every slid-out local block goes back young: one LRU in release order (no cold blocks at all)."""

    def _kept(self, seq: Sequence) -> tuple[range, ...]:
        return (range(len(seq.local_table)),)


class OldBlockManager(BlockManager):
    """The release rule before the hit point's window was kept: only the prompt-end window stays young."""

    def _kept(self, seq: Sequence) -> tuple[range, ...]:
        return super()._kept(seq)[:1]


def old_plan(num_blocks, block_size, is_global, window, max_num_seqs, max_step_tokens) -> PoolPlan:
    """plan_pools with the earlier cap: at most max_num_seqs finished windows (window/bs + 1 blocks each)."""
    plan = plan_pools(num_blocks, block_size, is_global, window, max_num_seqs, max_step_tokens)
    per_window = -(-window // block_size)
    running = max_num_seqs * (per_window + 3) + -(-max(max_step_tokens, max_num_seqs) // block_size)
    local = min(num_blocks, running + min(max_num_seqs * (per_window + 1), max(0, num_blocks - running) // 3))
    n_layers, n_global = len(is_global), sum(is_global)
    return PoolPlan((num_blocks * n_layers - local * (n_layers - n_global)) // n_global, local, plan.window)


def edited_turns(trace) -> set[tuple[int, int]]:
    """(session, turn) of the turns whose history differs from the previous turn's before its end."""
    out = set()
    for s, turns in enumerate(trace):
        for t in range(1, len(turns)):
            prev, cur = turns[t - 1][1], turns[t][1]
            if any(a is not b for a, b in zip(prev, cur)):
                out.add((s, t))
    return out


def run_worker_turn(sched: Scheduler, seqs: list[Sequence], max_tokens: int) -> None:
    """Engine.step without the model, until every sequence in `seqs` is finished."""
    for seq in seqs:
        sched.add(seq)
    while any(s.finish_reason is None for s in seqs):
        scheduled = sched.schedule()
        assert scheduled, "nothing scheduled: the pools cannot hold these sequences"
        for seq, n in scheduled:
            seq.num_computed += n
            sched.blocks.commit_full_blocks(seq)
        for seq, _ in scheduled:
            if seq.num_computed == len(seq.token_ids):  # a sampled row: prefill done, or a decode step
                seq.token_ids.append(GEN_TOKEN)
                if seq.num_output >= max_tokens:
                    sched.finish(seq, "length")
        sched.blocks.flush_events()


def replay(prompts: dict, n_sessions: int, n_turns: int, workers: int, make_blocks, sizes: dict,
           max_tokens: int) -> dict[tuple[int, int], int]:
    """Cached tokens per (session, turn): turn-major, every session's turn t queued at once on its worker."""
    scheds = [Scheduler(make_blocks(), sizes["max_num_seqs"], sizes["max_step_tokens"]) for _ in range(workers)]
    cached = {}
    for t in range(n_turns):
        per_worker: dict[int, list[tuple[int, Sequence]]] = {}
        for s in range(n_sessions):
            seq = Sequence(f"s{s}t{t}", list(prompts[s, t]), max_tokens=max_tokens)
            per_worker.setdefault(s % workers, []).append((s, seq))
        for w, items in per_worker.items():
            run_worker_turn(scheds[w], [seq for _, seq in items], max_tokens)
            for s, seq in items:
                cached[s, t] = seq.num_cached
    return cached


def summarize(name: str, prompts: dict, cached: dict, edited: set) -> dict:
    groups = {"first": [k for k in prompts if k[1] == 0],
              "later": [k for k in prompts if k[1] > 0 and k not in edited],
              "edited": [k for k in prompts if k in edited], "all": list(prompts)}
    row = {"policy": name}
    for g, keys in groups.items():
        row[g] = sum(len(prompts[k]) - cached[k] for k in keys) / len(keys) if keys else None
        row[g + "_n"] = len(keys)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=14)
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--tool-words", type=int, nargs=2, default=(500, 1100))
    ap.add_argument("--edit-prob", type=float, default=TraceSpec.edit_prob)
    ap.add_argument("--seed", type=int, default=TraceSpec.seed)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=3000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-step-tokens", type=int, default=2048, help="the engine's max_prefill_tokens default")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()
    spec = TraceSpec(sessions=a.sessions, turns=a.turns, system_words=a.system_words,
                     tool_words=tuple(a.tool_words), edit_prob=a.edit_prob, seed=a.seed)
    trace = build_trace(spec, "window-hits")
    encode = prompt_builder(None)
    prompts = {(s, t): encode(msgs) for s, turns in enumerate(trace) for t, (_, msgs) in enumerate(turns)}
    edited = edited_turns(trace)
    info = load_model_info(None)
    cfg = Gemma3Config.from_hparams(info.hparams, info.vocab_size)
    is_global = [cfg.is_global(i) for i in range(cfg.n_layers)]
    sizes = {"max_num_seqs": a.max_num_seqs, "max_step_tokens": a.max_step_tokens}
    bs = a.block_size
    new = plan_for(cfg, a.kv_blocks, bs, a.max_num_seqs, a.max_step_tokens)
    old = old_plan(a.kv_blocks, bs, is_global, cfg.window, a.max_num_seqs, a.max_step_tokens)
    policies = {"old": (OldBlockManager, old), "old rule, new sizing": (OldBlockManager, new),
                "new rule, old sizing": (BlockManager, old), "new": (BlockManager, new),
                "plain LRU, new sizing": (LruBlockManager, new)}
    rows, plans = [], {}
    for name, (cls, plan) in policies.items():
        plans[name] = {"global": plan.num_global, "local": plan.num_local}
        cached = replay(prompts, a.sessions, a.turns, a.workers, lambda c=cls, p=plan: c.from_plan(p, bs),
                        sizes, a.max_tokens)
        rows.append(summarize(name, prompts, cached, edited))
    order = [(s, t) for t in range(a.turns) for s in range(a.sessions)]  # the send order of the replay
    oracle = oracle_hits([prompts[k] for k in order], bs, a.kv_blocks * a.workers)
    rows.append(summarize("oracle", prompts, dict(zip(order, oracle)), edited))
    print(f"trace: {a.sessions} sessions x {a.turns} turns, system {a.system_words} words, tool {a.tool_words} words; "
          f"prompts up to {max(map(len, prompts.values()))} tokens; {a.workers} workers, session s on s % "
          f"{a.workers}; kv_blocks {a.kv_blocks}, max_num_seqs {a.max_num_seqs}, step {a.max_step_tokens}")
    sizings = {"old sizing": old, "new sizing": new}
    print("pools per worker (global/local blocks): " + "; ".join(f"{k} {p.num_global}/{p.num_local}"
                                                                for k, p in sizings.items()) + "\n")
    n = rows[0]
    print(f"| policy | first turns ({n['first_n']}) | later turns ({n['later_n']}) | edited turns ({n['edited_n']}) "
          f"| all ({n['all_n']}) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | " + " | ".join("-" if r[g] is None else f"{r[g]:.0f}"
                                                  for g in ("first", "later", "edited", "all")) + " |")
    print("\nuncached prompt tokens per request (prompt tokens - cached tokens), mean per group")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "plans": plans, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
