"""The engine step's host-side work the device never sees, timed alone: its microseconds add straight to every
step at high batch. Parts: `build_batch` (workers/cupy/batch.py, the step's inputs) and `emit` (the output loop:
Engine.append_tokens, each sequence's sampled token appended and its StepOutput made).

    python -m bench.step_host --batches 64 256 --context 200 --repeats 5
    git show REV:workers/cupy/batch.py > /tmp/batch_rev.py
    python -m bench.step_host --baseline /tmp/batch_rev.py    # another version beside it, interleaved
    git show REV:workers/cupy/engine.py > /tmp/engine_rev.py
    python -m bench.step_host --part emit --baseline /tmp/engine_rev.py
    python -m bench.step_host --part rows --batches 256 --baseline /tmp/engine_rev.py

Decode steps of B sequences (one new token each, `--context` tokens known, block size 16, blocks given by a
BlockManager), with one KV pool and with two (Gemma 3's sliding-window layers: a second block table per
sequence, its early blocks slid out). A batch.py from before BlockTables flattens the lists as it did then.
`--part step`: a whole Engine.step() over a model that costs nothing (a test double isolating the host work),
with workers.engine.overlap on (this tree's column) and off (the baseline column); `--churn N`: N sequences finish
each step and as many requests arrive (the served load at a full batch: 256 clients x 128 tokens is 2 a step).
Prints, per batch and layout, the median (min–max over --repeats) of microseconds per call, each repeat the
mean of --calls calls after a warm-up. Host time only: the arrays stay NumPy, as the GPU engine builds them.
For `emit` no sequence finishes during the timing (as in ~127 of a 128-token request's 128 steps); an
engine.py from before append_tokens is timed as its step ran it then (append_token and output_for per sequence).
`rows`: Engine.sample_rows (each row's key, temperature and logprobs ask, as the sampler stages them) over a list of
sequences that differs from the call before (the first sequence moved to the end), as under load, where a request
ends and another joins most steps; `--same` keeps one list (its per-list cache then answers).
`draws`: what a GPU step does with those rows on the host: sample_rows on a changed list, the device staging's pack
(pack_rows) and GpuSampler.hold's checks before it touches the device (the logprobs ask, then _drawn_in_step), as
the imported tree has them (no CuPy needed: the checks read the model's last draw through a stand-in).
`spec`: a whole speculative Engine.step() at one to a few streams, where the served copy is host-bound between
device waits (issue 19's code edits at 1 client): the engine over CopyModel (a model that costs nothing whose
greedy choice after token t is t's successor in a fixed cycle; the prompts are that cycle, so prompt lookup's
drafts are kept, a copy at its best), a Speculator of fixed K (`--k`), greedy requests of `--tokens` new tokens
replaced as they finish (their prefill steps counted, as served); `--miss N`: at every position divisible by N the
model takes another token, so drafts break and the drafter searches again. The baseline column is the same engine
with speculation off (a plain step emits one token a sequence, a speculative one up to K + 1).

Against another commit when more than one file changed (any part): run this file with that commit's tree first on
the path, alternately, and compare the same column over the rounds (this box's load moves between processes):

    git worktree add /tmp/base REV
    for i in $(seq 8); do PYTHONPATH=/tmp/base python bench/step_host.py --part step --churn 2; \
                          python bench/step_host.py --part step --churn 2; done
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time

import numpy as np

from bench.machine import describe, machine_info
from workers.cupy.batch import build_batch
from workers.cupy.kv_cache import BlockManager, BlockTables
from workers.cupy.sequence import Sequence
from workers.protocol import SamplingParams

BLOCK = 16
WINDOW = 64  # two pools: the last 4 blocks of a sequence's local table are held, the earlier ones slid out


def decode_step(batch: int, context: int, two_pools: bool) -> tuple[list[tuple[Sequence, int]], BlockTables]:
    """B sequences of `context` distinct tokens given blocks by a BlockManager as the engine's are (with two
    pools, a WINDOW-token window: the early local blocks slid out), each scheduled for its last token; and
    the manager's BlockTables (the rows build_batch gathers)."""
    per_seq = -(-context // BLOCK)
    local = batch * (min(per_seq, WINDOW // BLOCK + 2) + 1) if two_pools else None
    blocks = BlockManager(batch * per_seq + 1, BLOCK, num_local=local, window=WINDOW if two_pools else None)
    out = []
    for i in range(batch):
        seq = Sequence(request_id=str(i), token_ids=list(range(i * context, (i + 1) * context)), max_tokens=128,
                       sampling=SamplingParams())
        blocks.match_prefix(seq)
        blocks.allocate(seq, context)
        seq.num_computed = context - 1
        blocks.commit_full_blocks(seq)
        out.append((seq, 1))
    return out, blocks.tables


def load_module(path: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def rows_loop(engine_module, same: bool = False):
    """A (scheduled, block_size, xp) -> rows callable running `engine_module`'s Engine.sample_rows on the step's
    sequences, alternately in two orders (the first moved to the end) unless `same`."""
    eng = engine_module.Engine.__new__(engine_module.Engine)  # sample_rows touches only its per-list cache
    flip = [False]

    def run(scheduled, block_size, xp, tables=None):
        seqs = [seq for seq, _ in scheduled]
        flip[0] = not flip[0]
        return eng.sample_rows(seqs if same or flip[0] else seqs[1:] + seqs[:1])
    return run


def draws_loop(engine_module):
    """A (scheduled, block_size, xp) -> None callable: sample_rows as rows_loop, then pack_rows into a staging
    array and GpuSampler.hold's checks (the imported tree's: with or without sampler.rows_ask)."""
    import types

    from workers.cupy import sampler
    from workers.cupy.gpu import GpuSampler

    rows_of = rows_loop(engine_module)
    gs = GpuSampler.__new__(GpuSampler)  # only what _drawn_in_step reads
    logits = object()
    out = np.zeros((4096, 4), np.int32)
    if hasattr(sampler, "rows_ask"):
        def logprobs_asked(rows):
            return sampler.rows_ask(rows, sampler.ASK_LOGPROBS)
    else:  # the check as hold() made it before SampleRows.asks
        def logprobs_asked(rows):
            return any(r.logprobs is not None for r in rows)

    def run(scheduled, block_size, xp, tables=None):
        rows = rows_of(scheduled, block_size, xp)
        gs.model = types.SimpleNamespace(last_chosen=out[: len(rows), 0], last_logits=logits)
        gs.draws = types.SimpleNamespace(rows=len(out))
        sampler.pack_rows(rows, out[: len(rows)])
        assert not logprobs_asked(rows) and gs._drawn_in_step(logits, rows, None, rows)
    return run


def output_loop(engine_module):
    """A (scheduled, block_size, xp) -> outputs callable running `engine_module`'s output loop on the step's
    sequences, each given token 1000 + its index; the tokens it appends are removed again after each call."""
    eng = engine_module.Engine.__new__(engine_module.Engine)  # only what the loop touches: nothing finishes
    eng.seqs, eng.constraints, eng.scheduler = {}, None, None

    def run(scheduled, block_size, xp, tables=None):
        seqs = [seq for seq, _ in scheduled]
        tokens = list(range(1000, 1000 + len(seqs)))
        if hasattr(eng, "append_tokens"):
            out = eng.append_tokens(seqs, tokens, None, [None] * len(seqs))
        else:  # before append_tokens: two calls per sequence
            out = []
            for seq, token in zip(seqs, tokens):
                eng.append_token(seq, token)
                out.append(eng.output_for(seq, [token], None))
        for seq in seqs:
            seq.token_ids.pop()
        return out
    return run


class FreeModel:
    """A model whose forward costs nothing: the step's host work alone (`--part step`). One fixed token wins."""

    xp = np
    vocab = 512

    def forward(self, batch, kv):
        out = np.zeros((int(batch.logits_indices.shape[0]), self.vocab), np.float32)
        out[:, 7] = 1.0
        return out


class CopyModel:
    """A model whose forward costs nothing and continues a cycle (`--part spec`): after token t its logits pick
    SUCC[t], but at positions divisible by `miss` (0: never) the token after that, as a copy that leaves its
    source; its logits row i is the input token at logits_indices[i] (a verify row's is its draft token)."""

    xp = np
    vocab = 512
    CYCLE = np.random.default_rng(0).permutation(np.arange(2, 2 + 211))  # 211 distinct tokens, one order: a 256-token
    # prompt holds the whole cycle, so its continuation is a copy from the first new token on
    SUCC = np.zeros(vocab, np.int64)
    SUCC[CYCLE] = np.roll(CYCLE, -1)

    def __init__(self, miss: int = 0):
        self.miss = miss

    def forward(self, batch, kv):
        rows = np.asarray(batch.logits_indices)
        nxt = self.SUCC[np.asarray(batch.token_ids)[rows]]
        if self.miss:
            off = np.asarray(batch.positions)[rows] % self.miss == 0
            nxt[off] = self.SUCC[nxt[off]]
        out = np.zeros((len(rows), self.vocab), np.float32)
        out[np.arange(len(rows)), nxt] = 1.0
        return out


def spec_step(batch: int, k: int | None, tokens: int, miss: int, prompt: int = 256):
    """A (scheduled, block_size, xp, tables) -> outputs callable: one Engine.step() of an engine over CopyModel with
    `batch` greedy requests of `tokens` new tokens each (a finished one replaced by a new one, its prompt a
    different stretch of the cycle), speculation at fixed K `k` (None: off), workers.engine.overlap on."""
    from bench.speculation import fixed_k, set_policy
    from workers.cupy.engine import Engine
    from workers.cupy.scheduler import Scheduler
    from workers.protocol import GenerateRequest

    per_seq = -(-(prompt + tokens + 64) // BLOCK)
    blocks = BlockManager(4 * batch * per_seq + 1, BLOCK)
    eng = Engine(CopyModel(miss), None, blocks, Scheduler(blocks, batch, max(2048, batch)),
                 staging_sampler(batch * (1 + (k or 0))),
                 (1,), 1 << 20, CopyModel.vocab, 0, True)
    set_policy(eng, fixed_k(k) if k else None)
    cycle, arrivals = CopyModel.CYCLE, iter(range(1 << 62))

    def add():
        n = next(arrivals)
        ids = [int(cycle[(n * 37 + j) % len(cycle)]) for j in range(prompt)]
        eng.add(GenerateRequest(request_id=str(n), prompt_ids=ids, max_tokens=tokens,
                                sampling=SamplingParams(temperature=0.0), ignore_eos=True))
    for _ in range(batch):
        add()

    def step(scheduled, block_size, xp, tables=None):
        outputs = eng.step()
        step.steps += 1
        for o in outputs:
            step.tokens += len(o.token_ids)
            if o.finish_reason is not None:
                add()
        return outputs
    step.steps = step.tokens = 0
    step.engine = eng
    return step


def staging_sampler(batch: int):
    """A sampler that packs each step's draw parameters as the GPU sampler stages them (rows of up to `batch`), and
    draws with one argmax over FreeModel's logits."""
    from workers.cupy.sampler import Sampler, pack_rows

    class StagingSampler(Sampler):
        def __init__(self):
            super().__init__(np)
            self.packed = np.zeros((batch + 1, 4), np.int32)

        def stage(self, rows):
            pack_rows(rows, self.packed[: len(rows)])

        def sample(self, logits, rows, index=None):
            return np.argmax(logits, axis=1).astype(np.int64), [None] * len(rows)

    return StagingSampler()


def whole_step(batch: int, context: int, two_pools: bool, overlap: bool, churn: int = 0, prompt: int = 32):
    """A (scheduled, block_size, xp, tables) -> outputs callable: one Engine.step() of an engine over FreeModel
    with `batch` sequences decoding, its sampler staging and packing the draws' parameters as the GPU sampler
    does (the draw itself: one argmax), `overlap` as workers.engine.overlap. `churn` 0: the sequences never
    finish; N: N of them finish each step (each lives batch / N steps, their ends staggered) and as many new
    requests of `prompt` distinct tokens arrive, so their prefill rides with the decodes as under load."""
    from workers.cupy.engine import Engine
    from workers.cupy.scheduler import Scheduler
    from workers.protocol import GenerateRequest

    per_seq = -(-(context + 4096) // BLOCK)
    local = batch * (WINDOW // BLOCK + 3) if two_pools else None
    blocks = BlockManager(batch * per_seq + 1, BLOCK, num_local=local, window=WINDOW if two_pools else None)
    eng = Engine(FreeModel(), None, blocks, Scheduler(blocks, batch, max(2048, batch)), staging_sampler(batch), (1,),
                 1 << 20, FreeModel.vocab, 0, overlap)
    life = max(1, batch // churn) if churn else 1 << 20
    for i in range(batch):
        eng.add(GenerateRequest(request_id=str(i), prompt_ids=[2 + (i + j) % 500 for j in range(context)],
                                max_tokens=(1 + i // churn) if churn else life,
                                sampling=SamplingParams(temperature=1.0), ignore_eos=True))
    while any(seq.num_computed < seq.num_prompt_tokens for seq in eng.seqs.values()):
        eng.step()
    arrivals = iter(range(batch, 1 << 62))

    def step(scheduled, block_size, xp, tables=None):
        outputs = eng.step()
        for o in outputs:
            if o.finish_reason is not None:  # a new request takes its place (distinct tokens: no cached prefix)
                n = next(arrivals)
                eng.add(GenerateRequest(request_id=str(n), prompt_ids=[2 + (n * 7 + j) % 509 for j in range(prompt)],
                                        max_tokens=life, sampling=SamplingParams(temperature=1.0), ignore_eos=True))
        return outputs
    return step


def per_call_us(build, step, calls: int) -> float:
    scheduled, tables = step
    for _ in range(max(10, calls // 10)):
        build(scheduled, BLOCK, np, tables)
    t0 = time.perf_counter()
    for _ in range(calls):
        build(scheduled, BLOCK, np, tables)
    return (time.perf_counter() - t0) / calls * 1e6


def cell(runs: list[float]) -> str:
    runs = sorted(runs)
    return f"{runs[len(runs) // 2]:.0f} ({runs[0]:.0f}–{runs[-1]:.0f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--same", action="store_true", help="--part rows: the same list of sequences every call")
    ap.add_argument("--k", type=int, default=8, help="--part spec: the fixed draft depth")
    ap.add_argument("--tokens", type=int, default=128, help="--part spec: new tokens a request")
    ap.add_argument("--miss", type=int, default=0, help="--part spec: the model leaves the copy at every position "
                    "divisible by this (0: never)")
    ap.add_argument("--part", choices=["build_batch", "emit", "rows", "draws", "step", "spec"], default="build_batch",
                    help=(
        "step: a whole Engine.step() over a model that costs nothing, with workers.engine.overlap on and off "
        "(the baseline column is overlap off)"))
    ap.add_argument("--churn", type=int, default=0, help=(
        "--part step: sequences that finish each step, replaced by as many new requests (their prefill rides with "
        "the decodes, as under load); 0: none finish"))
    ap.add_argument("--baseline", help="another batch.py (--part build_batch) or engine.py (--part emit, rows), e.g. "
                    "from `git show REV:workers/cupy/batch.py`, timed beside this one, repeat by repeat")
    args = ap.parse_args(argv)
    if args.part == "step":
        builds = {"this tree": None, "baseline": None}  # overlap on and off: built per batch and layout, below
        args.baseline = args.baseline or "overlap off"
    elif args.part == "spec":
        builds = {f"K {args.k}": None, "off": None}  # built per batch, below
        args.baseline = "speculation off"
    elif args.part in ("emit", "rows", "draws"):
        from workers.cupy import engine
        loop = {"emit": output_loop, "rows": lambda m: rows_loop(m, args.same), "draws": draws_loop}[args.part]
        builds = {"this tree": loop(engine)}
        if args.baseline:
            builds["baseline"] = loop(load_module(args.baseline, "engine_baseline"))
    else:
        builds = {"this tree": lambda s, bs, xp, tables: build_batch(s, bs, xp, tables=tables)}
        if args.baseline:
            old = load_module(args.baseline, "batch_baseline").build_batch
            if "tables" in inspect.signature(old).parameters:
                builds["baseline"] = lambda s, bs, xp, tables: old(s, bs, xp, tables=tables)
            else:  # from before BlockTables: the lists flattened every step
                builds["baseline"] = lambda s, bs, xp, tables: old(s, bs, xp)
    print(describe(machine_info()))
    spec = args.part == "spec"
    print("| batch | KV pools | " + " | ".join(f"{name}: {args.part} us/call, median (min–max)" for name in builds)
          + (" | this / baseline |" if args.baseline else " |") + (" tokens a step (each column) |" if spec else ""))
    print("|" + " --- |" * (2 + len(builds) + bool(args.baseline) + spec))
    for batch in args.batches:
        for two in ((False,) if args.part == "spec" else (False, True)):
            step = decode_step(batch, args.context, two)
            if args.part == "spec":
                builds = {f"K {args.k}": spec_step(batch, args.k, args.tokens, args.miss),
                          "off": spec_step(batch, None, args.tokens, args.miss)}
            if args.part == "step":
                builds = {"this tree": whole_step(batch, args.context, two, True, args.churn),
                          "baseline": whole_step(batch, args.context, two, False, args.churn)}
            runs: dict[str, list[float]] = {name: [] for name in builds}
            for _ in range(args.repeats):  # interleaved: the box's load moves both alike
                for name, build in builds.items():
                    runs[name].append(per_call_us(build, step, args.calls))
            row = f"| {batch} | {'two' if two else 'one'} | " + " | ".join(cell(r) for r in runs.values())
            if args.part == "spec":
                row += f" | {np.median(runs[f'K {args.k}']) / np.median(runs['off']):.2f} | " + " / ".join(
                    f"{b.tokens / max(1, b.steps):.2f}" for b in builds.values())
            elif args.baseline:
                row += f" | {np.median(runs['this tree']) / np.median(runs['baseline']):.2f}"
            print(row + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
