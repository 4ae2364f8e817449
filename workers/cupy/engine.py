"""The engine's step loop: schedule, build the step's inputs, run the model, sample, update sequences.

Single-threaded by design: backend.py runs `step()` in its own thread and is the only caller. Token-level
stopping (EOS / stop token ids, max tokens, context length) happens here; stop strings are text, so the
backend matches them after detokenizing and aborts the sequence.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain, repeat

import msgspec
import numpy as np

from workers.cupy.batch import build_batch
from workers.cupy.kv_cache import BlockManager, KVStorage, plan_for
from workers.cupy.rng import index_keys
from workers.cupy.sampler import ASK_PENALIZED, Sampler, SampleRow, packed_rows, row_asks, rows_ask
from workers.cupy.scheduler import Scheduler
from workers.cupy.sequence import SeqStatus, Sequence
from workers.protocol import GenerateRequest, TokenLogprob

RATE_WINDOW_S = 5.0  # tokens/s in stats are averaged over this many recent seconds
PENDING = -1  # a token id not read yet: its step was launched, and the next one with it (Engine.step)


class StepOutput(msgspec.Struct, array_like=True):
    """One sequence's tokens from one step. A msgspec Struct: cheap to make on the step thread, and an engine
    process (workers/cupy/engine_process.py) sends a hand-over's outputs as one msgpack array, ~5x cheaper to
    encode and decode than pickling them."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0  # speculation, cumulative for the request
    accepted_tokens: int = 0


# Engine.phase_seconds' parts of a step: scheduling (both schedule() calls), building a step's inputs (batch, sample
# rows, the sampler's staging), launching its forward (the model's host side), appending the read tokens, committing
# full blocks, a speculative step whole (propose and verify) less its wait for the ids; then EngineLoop's, between
# steps: handing outputs over and applying queued adds and aborts. The wait for a step's tokens (a verify step's too)
# is token_wait_seconds.
PHASES = ("schedule", "build", "forward", "append", "commit", "speculate", "handover", "inbox")


@dataclass(eq=False)
class _Launched:
    """A step whose forward (and on a GPU its draw) is launched and whose tokens are not read yet."""

    seqs: list[Sequence]  # one per sample row
    rows: list[SampleRow]
    logits: object
    prefilled: int
    # where each sequence's token goes in its token_ids once a step launched after this one gave it a PENDING
    # placeholder there (_launch_ahead); None: at the end
    at: list[int] | None = None
    early: set = field(default_factory=set)  # finished by length before the read: their last token is this one
    ready: object = None  # Sampler.hold's callable when the draws were held for a step launched after this one
    ahead: bool = False  # launched before the step before it was read: its sequences may have ended since
    ran: list[Sequence] = field(default_factory=list)  # every sequence in the step (prefill chunks too)


class Engine:
    _row_inputs = None  # sample_rows' per-sequence inputs for its last list of sequences

    def __init__(self, model, kv: KVStorage, blocks: BlockManager, scheduler: Scheduler, sampler: Sampler,
                 eos_token_ids: tuple[int, ...], context_length: int, vocab_size: int, seed: int | None = None,
                 overlap: bool = False):
        self.model, self.kv, self.blocks, self.scheduler, self.sampler = model, kv, blocks, scheduler, sampler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length, self.vocab_size = context_length, vocab_size
        self.rng = np.random.default_rng(seed)
        self.seqs: dict[str, Sequence] = {}
        self.constraints = None  # workers.cupy.constrain.Constraints: set by the backend to serve grammars
        self.speculator = None  # workers.cupy.speculative.Speculator: set by the backend to draft and verify
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, generated, prefilled) per step
        # launch each step before reading the one before it (step()); the GPU engine's default
        self.overlap = overlap
        # arrivals beside decodes join a step only up to the model's largest mixed graph (scheduler.py); off by
        # default (`workers.engine.fit_graphs`)
        self.fit_graphs = False
        self._ahead: _Launched | None = None  # the step launched ahead, read by the next step() call
        # requests whose every step needs the host between steps (logprobs, penalties, a grammar): never ahead
        self._host_bound: set[str] = set()
        self.steps_ahead = 0  # steps launched before the previous one was read (stats)
        # cumulative seconds in step() that produced a step, and the part of them spent in _read getting a step's
        # tokens (on a device engine: waiting for the device to finish the step, then the copy): their ratio says
        # whether a busy step thread waits on the device or on its own host work (bench/served.py's wait_share)
        self.step_seconds = 0.0
        self.token_wait_seconds = 0.0
        # the step thread's cumulative seconds by part of a step (and, from EngineLoop, between steps): where a
        # host-bound step goes, read from the served engine's stats without a profiler (bench/served.py's phases)
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)

    @property
    def capacity_tokens(self) -> int:
        """Longest sequence (prompt + output) the engine can hold: context length and the whole KV cache."""
        return min(self.context_length, self.blocks.num_blocks * self.blocks.block_size)

    def add(self, request: GenerateRequest) -> Sequence:
        """Queue a request; ValueError (a client error) when it cannot be served at all."""
        prompt = list(request.prompt_ids)
        resume = list(request.resume_ids)  # a migrated generation's tokens so far: prefilled, counted as output
        if not prompt:
            raise ValueError("the prompt is empty")
        if request.request_id in self.seqs:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if min(prompt + resume) < 0 or max(prompt + resume) >= self.vocab_size:
            raise ValueError("prompt token id out of the vocabulary's range")
        if len(resume) >= request.max_tokens:
            raise ValueError("resume_ids must be shorter than max_tokens")
        room = self.capacity_tokens - len(prompt)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this engine holds at most "
                             f"{self.capacity_tokens - 1} prompt tokens")
        stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(self.eos_token_ids))
        seq = Sequence(
            request_id=request.request_id, token_ids=prompt + resume, num_prompt_tokens=len(prompt),
            max_tokens=min(request.max_tokens, room),
            sampling=request.sampling, stop_token_ids=frozenset(stop_ids), logprobs=request.logprobs,
            seed=request.sampling.seed if request.sampling.seed is not None else int(self.rng.integers(1 << 63)),
        )
        if request.grammar is not None:
            if self.constraints is None:
                raise ValueError("this engine does not serve constrained (grammar) requests")
            self.constraints.attach(seq.request_id, request.grammar)  # GrammarError (a ValueError) if bad
            for token in resume:  # the grammar's state after the tokens the first worker produced
                self.constraints.advance([seq.request_id], [token])
        if self.speculator is not None:
            self.speculator.attach(seq, request)
        if request.logprobs is not None or request.sampling.penalized or request.grammar is not None:
            self._host_bound.add(seq.request_id)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str, reason: str = "cancelled") -> StepOutput | None:
        seq = self.seqs.pop(request_id, None)
        self._host_bound.discard(request_id)
        if self.constraints is not None:
            self.constraints.release(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            return None
        if seq.token_ids[-1] == PENDING:  # in the step launched ahead: its token there is never read
            seq.token_ids.pop()
        self.scheduler.finish(seq, reason)
        self.blocks.flush_events()
        return self.output_for(seq, [], None)

    def has_work(self) -> bool:
        return self._ahead is not None or self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one step and return its outputs.

        With `overlap`, a step is launched before the one before it is read: while the device computes step
        N + 1 the host reads step N's tokens, finishes sequences and hands outputs on, and the next call
        schedules and launches N + 2 before it waits for N + 1. Step N + 1's inputs are N's draws, which it
        takes on the device (Sampler.hold); each sequence carries a PENDING placeholder for the token it has
        not read yet, so scheduling, block tables and the draw's key index count it as they count any token.
        A sequence that N finishes by length is finished before N + 1 is scheduled (its slot may take a
        waiting request), one that N finishes on a stop token has its N + 1 row dropped when N + 1 is read
        (its KV write there lands in blocks it gave back, before anything later on the stream reuses them).
        Only steps whose draws the device makes are launched ahead (_launch_ahead says which)."""
        t0 = clock = time.perf_counter()
        ph = self.phase_seconds
        cur, self._ahead = self._ahead, None
        if cur is None:
            scheduled = self.scheduler.schedule(self._graph_tokens())
            ph["schedule"] += (now := time.perf_counter()) - clock
            if not scheduled:
                self.blocks.flush_events()
                return []
            drafts = self.speculator.propose(self, scheduled) if self.speculator is not None else None
            if drafts:  # some sequence has draft tokens: verify them all in this one forward (speculative.py)
                waited = self.token_wait_seconds
                outputs, prefilled = self.speculator.verify(self, scheduled, drafts)
                # its wait for the step's ids is counted as a plain step's is (token_wait_seconds), not as work
                ph["speculate"] += time.perf_counter() - now - (self.token_wait_seconds - waited)
                return self._stepped(outputs, prefilled, t0)
            ph["speculate"] += time.perf_counter() - now  # proposing none
            cur = self._launch(scheduled)
            clock = time.perf_counter()
            self.blocks.commit_steps(cur.ran)
            ph["commit"] += time.perf_counter() - clock
        nxt = self._launch_ahead(cur) if self.overlap else None
        outputs = self._read(cur)
        if nxt is not None:  # its sequences' tokens are all known now: blocks it filled can be hashed
            clock = time.perf_counter()
            self.blocks.commit_steps([seq for seq in nxt.ran if seq.status is SeqStatus.RUNNING])
            ph["commit"] += time.perf_counter() - clock
            self._ahead = nxt
        return self._stepped(outputs, cur.prefilled, t0, len(outputs))  # a plain step: one token an output

    def _stepped(self, outputs: list[StepOutput], prefilled: int, t0: float, emitted: int | None = None
                 ) -> list[StepOutput]:
        """`emitted`: the outputs' tokens when the caller knows them (counted here otherwise)."""
        self.blocks.flush_events()
        emitted = self._record(outputs, prefilled, emitted)
        took = time.perf_counter() - t0
        self.step_seconds += took
        if self.speculator is not None:
            self.speculator.observe(emitted, prefilled, took)
        return outputs

    def _launch(self, scheduled: list[tuple[Sequence, int]], ids=None) -> _Launched:
        """Build and launch a step of `scheduled` (sequence, new tokens); `ids`: (the previous step's held
        draws, {sequence: its index there}) for the sequences whose input is a PENDING token."""
        t0 = time.perf_counter()
        batch = build_batch(scheduled, self.blocks.block_size, self.model.xp, tables=self.blocks.tables)
        seqs = [scheduled[b][0] for b in batch.sample_rows]
        if ids is not None:
            self._take_pending(batch, scheduled, *ids)
        rows = self.sample_rows(seqs)  # built once: staged for the draw, then read back
        self.sampler.stage(rows)
        t1 = time.perf_counter()
        logits = self.model.forward(batch, self.kv)
        for seq, n in scheduled:
            seq.num_computed += n
        ph = self.phase_seconds
        ph["build"] += t1 - t0
        ph["forward"] += time.perf_counter() - t1
        return _Launched(seqs, rows, logits, batch.num_tokens - len(seqs), ran=[seq for seq, _ in scheduled])

    def _take_pending(self, batch, scheduled, draws, index: dict) -> None:
        """Put the held draws in the batch's token ids where a sequence's input is its PENDING token, in the
        sampler's array module: on the device with a device sampler, without the host reading them (the GPU
        model takes device token ids as they are)."""
        xp = self.sampler.xp
        draws = xp.asarray(draws)
        src = list(map(index.get, (seq for seq, _ in scheduled), repeat(-1)))  # its row in the held draws, or -1
        n = len(src)
        if n == batch.num_tokens == len(draws) and src == list(range(n)):  # the same sequences in the same order
            batch.token_ids = draws
            return
        src = np.asarray(src, np.int64)
        pending = src >= 0
        dst = batch.meta.query_start[:-1][pending].astype(np.int64)  # each pending sequence's one query row
        tokens = xp.asarray(batch.token_ids)
        tokens[xp.asarray(dst)] = draws[xp.asarray(src[pending])]
        batch.token_ids = tokens

    def _launch_ahead(self, cur: _Launched) -> _Launched | None:
        """Schedule and launch the step after `cur` before reading `cur`, or None (then `cur` is read as any
        step is): only when every running sequence is in `cur`, none is constrained, penalized or asks for
        logprobs, speculation would draft nothing, blocks suffice without preempting, and the sampler can
        hold `cur`'s draws on the device."""
        sched, seqs = self.scheduler, cur.seqs
        if len(seqs) != len(sched.running):
            return None  # a running sequence mid-prefill: an ordinary step
        if self._host_bound and any(s.request_id in self._host_bound for s in seqs):
            return None
        # one pass (per sequence per step): which sequences cur's token ends by length, which go on (their row in
        # cur's draws), and the new blocks those need (blocks_needed(s, 1) inline: where the next position
        # starts one)
        bs, running = self.blocks.block_size, SeqStatus.RUNNING
        going, ended, index, at, need = [], [], {}, [], 0
        for i, s in enumerate(seqs):
            if s.status is not running:
                return None  # ended since cur was launched: an ordinary step
            at.append(len(s.token_ids))  # where cur's token goes: the placeholder appended below, or the end
            if at[-1] + 1 - s.num_prompt_tokens >= s.max_tokens:
                ended.append(s)
            else:
                going.append(s)
                index[s] = i
                need += s.num_computed >= len(s.block_table) * bs
        if not self.blocks.can_take(need):
            return None  # the ordinary step preempts where it must
        if self.speculator is not None and going and not self.speculator.skip_drafts(self, going):
            return None
        held = self.sampler.hold(cur.logits, cur.rows)
        if held is None:
            return None
        cur.ready, cur.at = held[1], at
        for s in ended:
            cur.early.add(s)
            self._finish(s, "length")  # its output comes with cur's read
        for s in going:
            s.token_ids.append(PENDING)
        t0 = time.perf_counter()
        scheduled = sched.schedule(self._graph_tokens())
        self.phase_seconds["schedule"] += time.perf_counter() - t0
        if not scheduled:
            return None
        if self.speculator is not None and going:
            self.speculator.skipped()  # counted (a failed search's wait) only now that it is launched
        nxt = self._launch(scheduled, (held[0], index))
        nxt.ahead = True
        self.steps_ahead += 1
        return nxt

    def _read(self, cur: _Launched) -> list[StepOutput]:
        """`cur`'s tokens appended (or put in place of their placeholders) and its step outputs."""
        if cur.ready is not None:
            t0 = time.perf_counter()
            tokens, logprobs = cur.ready()
            self.token_wait_seconds += time.perf_counter() - t0
        else:  # choose counts its own wait
            tokens, logprobs = self.choose(cur.logits, cur.rows, [s.request_id for s in cur.seqs], seqs=cur.seqs)
        t1 = time.perf_counter()
        outputs = self.append_tokens(cur.seqs, tokens.tolist(), None, logprobs, cur.at,
                                     cur.early if cur.ahead or cur.early else None)
        self.phase_seconds["append"] += time.perf_counter() - t1
        return outputs

    def _record(self, outputs: list[StepOutput], prefilled: int, emitted: int | None = None) -> int:
        """A finished step's generated and prefilled tokens, for rates(); returns the generated count."""
        now = time.monotonic()
        if emitted is None:
            emitted = sum(len(o.token_ids) for o in outputs)
        self._recent.append((now, emitted, prefilled))
        while now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        return emitted

    def sample_rows(self, seqs: list[Sequence], ahead: list[int] | None = None) -> list[SampleRow]:
        """The sampler's row for each of `seqs`' next generated token (number num_output, plus its `ahead`
        offset where given: a verify step's drafted positions), the keys computed for all rows at once."""
        n = len(seqs)
        # what does not change while a sequence lives (its seed's key, prompt length, sampling and logprobs ask),
        # kept for the last list of sequences: most steps draw for the same sequences as the one before
        cached = self._row_inputs
        if cached is not None and cached[0] == seqs:  # list equality: identity first, per element
            sources, mixed, prompt, packed, asks = cached
        else:  # another list (under load, most steps: a request ended, another joined): each sequence's own
            # constants, computed once in its life (row_constants), into columns in one conversion
            cols = np.fromiter(chain.from_iterable(s.row_constants or row_constants(s) for s in seqs), np.uint64,
                               5 * n).reshape(n, 5)  # ~0.6x np.array's time on a list of tuples
            mixed, prompt = cols[:, 0], cols[:, 1]
            packed = np.empty((n, 4), np.int32)
            packed[:, 2:] = cols[:, 2:4].astype(np.uint32).view(np.int32)
            asks = int(np.bitwise_or.reduce(cols[:, 4])) if n else 0
            sources = list(seqs)  # kept by this cache and by the rows (their params and logprobs asks, when read)
            self._row_inputs = (sources, mixed, prompt, packed, asks)
        index = np.fromiter((len(s.token_ids) for s in seqs), np.uint64, n) - prompt  # num_output, no property
        if ahead is not None:
            index += np.asarray(ahead, np.uint64)
        return packed_rows(sources, *index_keys(mixed, index), packed, asks)

    def _sample(self, logits, seqs: list[Sequence], index=None, rows: list[SampleRow] | None = None
                ) -> list[StepOutput]:
        """Sample one token for each of `seqs` (their rows of `logits`, or `logits[index]`) and append it.
        `rows`: their sample rows when the step already built them (sample_rows of them, now)."""
        rows = rows if rows is not None else self.sample_rows(seqs)
        tokens, logprobs = self.choose(logits, rows, [s.request_id for s in seqs], index, seqs=seqs)
        return self.append_tokens(seqs, tokens.tolist(), None, logprobs)

    def choose(self, logits, rows: list[SampleRow], ids: list[str], index=None, drafts=None, seqs=None):
        """The sampler's tokens and logprobs for `rows` (request `ids`, one per row), penalties (`seqs`: the
        rows' sequences, for their output so far) and grammar masks applied first (`drafts`: {request id:
        draft} when rows are speculative verify positions; a penalized sequence never drafts); the
        constrained rows' matchers advance unless drafts are given (verification advances them by what it
        keeps). Its time (on a GPU: waiting for the step's ids) is counted in token_wait_seconds, whichever
        step (plain, speculative, a pipeline's) asks."""
        t0 = time.perf_counter()
        try:
            return self._choose(logits, rows, ids, index, drafts, seqs)
        finally:
            self.token_wait_seconds += time.perf_counter() - t0

    def _choose(self, logits, rows: list[SampleRow], ids: list[str], index, drafts, seqs):
        constrained = self.constraints is not None and any(i in self.constraints for i in ids)
        penalized = seqs is not None and rows_ask(rows, ASK_PENALIZED)
        if not constrained and not penalized:
            return self.sampler.sample(logits, rows, index)
        if index is not None:
            logits = logits[self.sampler.xp.asarray(np.asarray(index))]
        masked = logits.copy()  # logprobs report the model's own distribution, not the masked one
        if penalized:
            apply_penalties(self.sampler.xp, masked, seqs)
        if constrained:
            masked = (self.constraints.apply(masked, ids) if drafts is None
                      else self.constraints.apply_drafts(masked, ids, drafts))
        tokens = self.sampler.choose(self.sampler.mask_truncated(masked, rows), rows)
        if constrained and drafts is None:
            self.constraints.advance(ids, tokens.tolist())
        return tokens, self.sampler._logprobs(logits, tokens, rows)

    def append_tokens(self, seqs: list[Sequence], tokens: list[int], emitted: list[list[int]] | None,
                      logprobs: list, at: list[int] | None = None, early: set | None = None) -> list[StepOutput]:
        """Append each of `tokens` to its sequence of `seqs`, finishing it on a stop token or at its token limit,
        and return their step outputs: sequence i's carries `emitted[i]` (a verify step's kept tokens, which end
        with tokens[i]), or [tokens[i]] where `emitted` is None, and `logprobs[i]`.

        `at[i]`: where token i goes (a PENDING placeholder, or the end) in a step read after the next one was
        launched (step()); `early` (then not None): its sequences finished by length before this read, whose
        token still counts; any other sequence finished since the launch (cancelled, or stopped a step ago)
        gets no output.

        Once per sequence per step, so nothing is called per sequence but a finish: output_for's fields are
        filled inline (with append_token and output_for called per sequence it took 2.2x as long: 465 against
        205 us a step at 256 sequences on the dev box, `bench/step_host.py --part emit`)."""
        outputs = []
        add = outputs.append
        for i, (seq, token, lp) in enumerate(zip(seqs, tokens, logprobs)):
            ids = seq.token_ids
            if early is not None and seq.status is SeqStatus.FINISHED and seq not in early:
                continue
            j = len(ids) if at is None else at[i]
            if j == len(ids):
                ids.append(token)
            else:
                ids[j] = token
            prompt = seq.num_prompt_tokens
            n_out = j + 1 - prompt
            if token in seq.stop_token_ids:
                self._finish(seq, "stop")
            elif n_out >= seq.max_tokens and seq.status is not SeqStatus.FINISHED:
                self._finish(seq, "length")
            cached = seq.num_cached
            add(StepOutput(seq.request_id, [token] if emitted is None else emitted[i], lp, seq.finish_reason, prompt,
                           cached if 0 <= cached <= prompt else (0 if cached < 0 else prompt), n_out,
                           seq.num_drafted, seq.num_accepted))
        return outputs

    def _graph_tokens(self) -> int:
        """The most tokens a step with prompt chunks can have and replay a graph (GPU models; 0: none do, or
        `fit_graphs` is off: `workers.engine.fit_graphs`)."""
        return getattr(self.model, "mixed_step_tokens", 0) if self.fit_graphs else 0

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self._host_bound.discard(seq.request_id)
        if self.constraints is not None:
            self.constraints.release(seq.request_id)

    def output_for(self, seq: Sequence, tokens: list[int], logprobs) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id, token_ids=tokens, logprobs=logprobs, finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=min(max(seq.num_cached, 0), seq.num_prompt_tokens),
            completion_tokens=seq.num_output, drafted_tokens=seq.num_drafted, accepted_tokens=seq.num_accepted,
        )

    def rates(self) -> tuple[float, float]:
        """Generated and prefilled tokens per second over the last RATE_WINDOW_S (safe from any thread)."""
        now = time.monotonic()
        recent = [r for r in list(self._recent) if now - r[0] <= RATE_WINDOW_S]
        if not recent:
            return 0.0, 0.0
        span = max(now - recent[0][0], 1.0)
        return sum(r[1] for r in recent) / span, sum(r[2] for r in recent) / span


def row_constants(seq: Sequence) -> tuple[int, int, int, int, int]:
    """What a sequence's sample rows share all its life, kept on it: its seed's key, its prompt length, 1/T as
    float32 bits (0 when greedy: the packed temperature column, SampleRow.inv_temperature rounded to float32),
    whether it asks for logprobs, and what its rows ask beyond a plain draw (sampler.row_asks' bits)."""
    p = seq.sampling
    inv = 0 if p.greedy else int(np.float32(1.0 / p.temperature).view(np.uint32))
    seq.row_constants = (seq.seed_key(), seq.num_prompt_tokens, inv, int(seq.logprobs is not None),
                         row_asks(p, seq.logprobs))
    return seq.row_constants


def create_engine(info, weights: dict, xp, *, block_size: int, num_blocks: int, max_num_seqs: int,
                  max_step_tokens: int, context_length: int, block_sink=None, ops=None,
                  dtype: str = "float32", seed: int | None = None, model=None, window_pool: bool = True,
                  overlap: bool = False) -> Engine:
    """An engine for the model `info` describes, with its weights (host arrays by GGUF name) on `xp`.

    `model`: an already built model to share (several engines over one set of device weights).
    `num_blocks`: the KV budget in all-layer blocks; with `window_pool` the sliding-window layers get their
    own, smaller pool and the rest of those bytes go to the global layers (kv_cache.plan_pools).
    """
    from workers.cupy.models import build_model
    from workers.cupy.ops import Ops

    model = model or build_model(info, weights, ops or Ops(xp), dtype)
    plan = plan_for(model.cfg, num_blocks, block_size, max_num_seqs, max_step_tokens, window_pool)
    kv = model.kv_storage(plan.num_global, block_size, dtype, num_local=plan.num_local)
    blocks = BlockManager.from_plan(plan, block_size, block_sink, info.chain_root)
    scheduler = Scheduler(blocks, max_num_seqs, max_step_tokens)
    return Engine(model, kv, blocks, scheduler, Sampler(xp), info.eos_token_ids, context_length,
                  info.vocab_size, seed, overlap)


def apply_penalties(xp, logits, seqs: list[Sequence]) -> None:
    """OpenAI's presence and frequency penalties on `logits` (one row per sequence of `seqs`), in place:
    each token the sequence has generated so far (a migrated generation's resumed tokens included, the
    prompt not) loses frequency_penalty x its count, and presence_penalty once. One scattered subtraction
    for the whole batch; rows without penalties are untouched."""
    rows, tokens, amounts = [], [], []
    for i, seq in enumerate(seqs):
        p = seq.sampling
        if not p.penalized or not seq.num_output:
            continue
        ids, counts = np.unique(np.asarray(seq.token_ids[seq.num_prompt_tokens:], np.int64), return_counts=True)
        rows.append(np.full(ids.size, i, np.int64))
        tokens.append(ids)
        amounts.append(counts * p.frequency_penalty + p.presence_penalty)
    if rows:
        r, t = xp.asarray(np.concatenate(rows)), xp.asarray(np.concatenate(tokens))
        logits[r, t] -= xp.asarray(np.concatenate(amounts).astype(logits.dtype))  # (row, token) pairs are unique
