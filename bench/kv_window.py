"""KV memory per sequence with and without the sliding-window pool (workers/cupy/kv_cache.py), from the
engine's own allocator: the profile's KV budget is planned as the engine plans it, sequences are prefilled
in the scheduler's chunks and decoded a few tokens through BlockManager, and the blocks each pool holds are
counted. Bookkeeping only (no model run), so the figures are exact, not timed: no repeats needed.

    python -m bench.kv_window [--profile cpu] [--contexts 4096 8192 16384] [--json out.json]

Per context: KV bytes one sequence holds (global + local pool blocks x their layers' bytes), and how many
such sequences the budget holds at once (admitted one after another until a block is refused; capped by
the profile's max_num_seqs, which the local pool is sized for).
"""
from __future__ import annotations

import argparse
import json

from policy.profiles import builtin_profiles
from workers.cupy.gemma3 import Gemma3Config
from workers.cupy.kv_cache import BlockManager, plan_for
from workers.cupy.sequence import Sequence
from workers.protocol.model import load_model_info

BS = 16


def advance(blocks: BlockManager, seq: Sequence, n: int) -> bool:
    if not blocks.can_allocate(seq, n):
        return False
    blocks.allocate(seq, n)
    seq.num_computed += n
    blocks.commit_full_blocks(seq)
    return True


def run_sequence(blocks: BlockManager, seq: Sequence, chunk: int, decode: int) -> bool:
    """Prefill in `chunk`-token steps, then decode `decode` tokens; False if the blocks ran out."""
    while seq.num_remaining:
        if not advance(blocks, seq, min(chunk, seq.num_remaining)):
            return False
    for i in range(decode):
        seq.token_ids.append(i)
        if not advance(blocks, seq, 1):
            return False
    return True


def measure(cfg: Gemma3Config, profile, context: int, enabled: bool, itemsize: int, chunk: int) -> dict:
    num_blocks = profile.kv_cache_tokens // BS
    plan = plan_for(cfg, num_blocks, BS, profile.max_num_seqs, chunk, enabled)
    blocks = BlockManager.from_plan(plan, BS)
    n_global = sum(cfg.is_global(i) for i in range(cfg.n_layers)) if plan.window else cfg.n_layers
    layer_block = 2 * BS * cfg.n_kv_heads * cfg.head_dim * itemsize  # K and V of one layer's block
    fitted, per_seq = 0, None
    while fitted < profile.max_num_seqs:
        seq = Sequence(f"s{fitted}", list(range(fitted * 7, fitted * 7 + context)), max_tokens=64)
        if not run_sequence(blocks, seq, chunk, decode=16):
            break
        held_local = sum(b >= 0 for b in seq.local_table)
        if per_seq is None:
            per_seq = (len(seq.block_table) * n_global + held_local * (cfg.n_layers - n_global)) * layer_block
        fitted += 1
    return {"pool": "two pools" if plan.window else "one pool", "context": context,
            "global_blocks": plan.num_global, "local_blocks": plan.num_local,
            "kv_bytes_budget": num_blocks * cfg.n_layers * layer_block, "kv_bytes_per_seq": per_seq,
            "seqs_at_once": fitted, "context_tokens_held": plan.num_global * BS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--chunk", type=int, default=2048, help="the step's token budget (max_prefill_tokens)")
    ap.add_argument("--json")
    a = ap.parse_args()
    info = load_model_info(None)
    cfg = Gemma3Config.from_hparams(info.hparams, info.vocab_size)
    profile = builtin_profiles()[a.profile]
    itemsize = 4 if profile.kind == "cpu" else 2  # fp32 KV on the NumPy path, fp16/bf16 on a GPU
    rows = [measure(cfg, profile, c, enabled, itemsize, a.chunk) for c in a.contexts for enabled in (False, True)]
    print(f"profile {profile.name}: {profile.kv_cache_tokens} KV tokens x {cfg.n_layers} layers, "
          f"max_num_seqs {profile.max_num_seqs}, {itemsize}-byte KV, window {cfg.window}")
    print(f"{'context':>8} {'pools':>10} {'global/local blocks':>20} {'MiB/seq':>9} {'seqs':>5} {'ctx tokens':>11}")
    for r in rows:
        print(f"{r['context']:>8} {r['pool']:>10} {str(r['global_blocks']) + '/' + str(r['local_blocks']):>20} "
              f"{r['kv_bytes_per_seq'] / 2**20:>9.1f} {r['seqs_at_once']:>5} {r['context_tokens_held']:>11}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"profile": profile.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
