"""Speculation depth K: a pure function of what the worker sees at one decode step.

The worker calls `choose_k` for every decoding sequence at every step, with its live occupancy (the
sequences running in its batch now). A proxy in front of llama-server could only count its own requests,
so it was one request late at the start of a burst; the worker knows its batch exactly.

The device profile's `speculation` table is read top to bottom and the first rule that holds wins: a rule
holds when the context is below its `max_context`, the concurrency is at or below its `max_concurrency`
and, if the rule names a workload class, the sequence is of that class. No rule: K = 0. The profile's
`max_draft_tokens` caps every rule; a request's own `max_draft_tokens` may lower K further (0 disables
speculation for it) and can never raise it.

That K is a cap. `choose_depth` then picks each sequence's depth in 0..K from its own online acceptance
by draft position (`Acceptance`): the depth that gives the most tokens per unit of step cost, where a
draft token costs the profile's `draft_token_cost` of a batch-1 step. Text whose drafts are rejected
falls to depth 0 (a 1-token probe every PROBE_EVERY steps lets it come back); a code edit stays at K.

`SpeculationGate` sits above both: per concurrency bucket it times the engine's decode steps with
prompt-lookup drafting on and with it off, and keeps the one that emitted more tokens per second,
re-trying the other every few epochs. The cost model above is a guess per device (`draft_token_cost`);
the gate is the measurement. On the H200 the model said "draft" where drafting cost 25-40% (story text at
32 streams, temperature 1 at 1-8 streams: BENCHMARKS.md, served table), because a verify step costs more
than its extra tokens (another graph, the batch's other sequences wait for it) and no per-token constant
describes that.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from policy.profiles import DeviceProfile

# Workload classes the engine tells apart. "schema": grammar-constrained output (JSON schema, tool
# calls), which peaked at K = 3 on the GB10; "text": everything else (code and chat both peaked at K = 4).
SCHEMA = "schema"
TEXT = "text"


def choose_k(context_len: int, concurrency: int, workload: str, profile: DeviceProfile,
             request_cap: int | None = None) -> int:
    """Draft tokens for one sequence's next decode step (0: decode without speculation).

    context_len: the sequence's tokens so far (prompt + generated); concurrency: sequences running on
    this worker now, this one included; workload: SCHEMA or TEXT; request_cap: the request's
    `max_draft_tokens` (None: no cap of its own).
    """
    k = 0
    for rule in profile.speculation:
        if rule.workload is not None and rule.workload != workload:
            continue
        if context_len < rule.max_context and concurrency <= rule.max_concurrency:
            k = rule.k
            break
    k = min(k, profile.max_draft_tokens)
    if request_cap is not None:
        k = min(k, max(0, request_cap))
    return k


# Online acceptance: each drafted position's keep rate, given the one before it was kept, as an
# exponentially weighted average. A new sequence starts at PRIOR, so it drafts; a sequence at depth 0
# drafts one token every PROBE_EVERY steps so its estimate can recover when the text starts repeating.
PRIOR = 0.5
ALPHA = 0.25
PROBE_EVERY = 32


class Acceptance:
    """One sequence's acceptance estimate by draft position (1st, 2nd, ... draft token)."""

    def __init__(self, width: int = 16, prior: list[float] | None = None):
        """`prior`: where the estimate starts (AcceptancePrior: what the worker's recent sequences of the same
        kind ended with); None: PRIOR at every position."""
        self.rates = list(prior[:width]) if prior is not None else [PRIOR] * width
        self.idle = 0  # steps since this sequence last drafted because its estimate said no
        self.verified = 0  # drafts verified so far: 0, the estimate is still its prior

    def update(self, drafted: int, kept: int) -> None:
        """A verified draft: positions 1..kept were kept, position kept+1 (if drafted) was rejected;
        positions after that say nothing."""
        self.verified += 1
        for i in range(min(drafted, kept + 1, len(self.rates))):
            hit = 1.0 if i < kept else 0.0
            self.rates[i] += ALPHA * (hit - self.rates[i])

    def counted(self, depth: int) -> None:
        """A step at `depth` (cap > 0): drafting resets the wait for the next probe, depth 0 adds to it."""
        self.idle = 0 if depth > 0 else self.idle + 1

    def expected_kept(self, k: int) -> float:
        """Expected drafts kept at depth k: sum over i <= k of the chance the first i are all kept."""
        total, run = 0.0, 1.0
        for r in self.rates[:k]:
            run *= r
            total += run
        return total


# A new sequence's estimate starts from what the worker's recent sequences of its kind ended with, each that
# verified a draft moving it PRIOR_ALPHA of the way. A fixed 0.5 had every new sampled sequence draft 8 deep from its
# first step until enough rejections brought it down: on the H200 one client's sampled story text ran 0.90x of
# speculation off (BENCHMARKS.md, issue 19), each request paying those verify steps (run in order, not overlapped).
PRIOR_ALPHA = 0.5


class AcceptancePrior:
    """Per kind of sequence (the caller's key: e.g. sampled or greedy, drafting from its context or from a given
    prediction), the acceptance by draft position that a new sequence of that kind starts from.

        acc = prior.start(kind)      # a new sequence's Acceptance
        prior.ended(kind, acc)       # it finished: its estimate teaches the next ones (if it verified a draft)
    """

    def __init__(self, width: int = 16):
        self.width = width
        self._rates: dict[object, list[float]] = {}

    def start(self, kind) -> Acceptance:
        return Acceptance(self.width, self._rates.get(kind))

    def ended(self, kind, acceptance: Acceptance) -> None:
        if not acceptance.verified:  # it never drafted: its estimate is only the prior it was given
            return
        rates = self._rates.setdefault(kind, [PRIOR] * self.width)
        for i, r in enumerate(acceptance.rates[: self.width]):
            rates[i] += PRIOR_ALPHA * (r - rates[i])

    def snapshot(self) -> dict:
        """{kind: [rate by draft position]} for /stats."""
        return {str(kind): [round(r, 3) for r in rates] for kind, rates in self._rates.items()}


def tokens_per_cost(expected_kept: float, k: int, concurrency: int, draft_token_cost: float) -> float:
    """Tokens a sequence emits per unit of step cost at depth k. A step of T tokens costs
    1 + c (T - 1) batch-1 decode steps (c = draft_token_cost, per device); a sequence's share of a
    batch of `concurrency` is that cost over the batch, plus c for each of its own drafts."""
    b = max(concurrency, 1)
    share = (1.0 + draft_token_cost * (b - 1)) / b + draft_token_cost * k
    return (1.0 + expected_kept) / share


def next_depth(cap: int, acceptance: Acceptance, concurrency: int, draft_token_cost: float) -> int:
    """The depth in 0..cap that gives the most tokens per unit of step cost under this sequence's estimate;
    0 when no depth beats plain decoding, except a 1-token probe when PROBE_EVERY such steps are due. Pure: the
    engine asks it before it launches a step ahead (workers/cupy/speculative.py); `counted` books the step."""
    if cap <= 0:
        return 0
    best, best_rate = 0, tokens_per_cost(0.0, 0, concurrency, draft_token_cost)
    for k in range(1, cap + 1):
        rate = tokens_per_cost(acceptance.expected_kept(k), k, concurrency, draft_token_cost)
        if rate > best_rate:
            best, best_rate = k, rate
    if best == 0 and acceptance.idle + 1 >= PROBE_EVERY:
        return 1
    return best


def choose_depth(cap: int, acceptance: Acceptance, concurrency: int, draft_token_cost: float) -> int:
    """next_depth, with the step counted toward (or resetting) the sequence's next probe."""
    k = next_depth(cap, acceptance, concurrency, draft_token_cost)
    if cap > 0:
        acceptance.counted(k)
    return k


# The gate: decode steps are timed in epochs of GATE_EPOCH_STEPS steps, all with drafting on or all off;
# GATE_EXPLORE_EVERY epochs after a bucket last tried it, one epoch runs the mode that measured worse, so a change in
# the traffic (text turning into a code edit) is noticed. Each mode's rate is a moving average over epochs. Where one
# mode measured at least GATE_CLEAR_RATIO times the other (drafting on a code edit at one stream: 2.5-3x on the
# H200), the other is re-tried GATE_CLEAR_SLOWER times less often: each such epoch costs most of its steps' gain.
# Each re-try that finds the worse mode still worse doubles the wait for the next, up to 2**GATE_BACKOFF_MAX
# times; one that finds it better switches to it and starts the waits over. At a fixed one in eight, one client's
# sampled story text on the H200 spent 1 epoch in 8 drafting at a loss, most of its 0.90x of speculation off.
GATE_EPOCH_STEPS = 16
GATE_EXPLORE_EVERY = 8
GATE_ALPHA = 0.5
GATE_CLEAR_RATIO = 2.0
GATE_CLEAR_SLOWER = 4
GATE_BACKOFF_MAX = 3


@dataclass
class _GateBucket:
    drafting: bool = True  # the mode of the epoch under way
    steps: int = 0
    tokens: float = 0.0  # tokens per running sequence, summed over the epoch's steps
    seconds: float = 0.0
    epochs: int = 0
    rate: dict = field(default_factory=dict)  # {drafting: tokens per second}
    exploring: bool = False  # the epoch under way re-tries the mode that measured worse
    confirmed: int = 0  # re-tries in a row that found it still worse (the wait for the next doubles with each)
    next_explore: int = 0  # the epoch count after which the next re-try runs (0: not yet set)


class SpeculationGate:
    """Per concurrency bucket (1, 2-3, 4-7, ... sequences running) and per kind of batch (mostly greedy, or
    mostly sampled), whether prompt-lookup drafting pays on this device and traffic now, from the engine's own
    decode-step timings. Sampled batches keep books of their own: at temperature 1 far fewer drafts are kept,
    and on the H200 greedy story text at 8 streams drafted to 1.63x while the same text sampled lost 13%
    (BENCHMARKS.md, issue 19), so a bucket that learned "draft" from greedy traffic was wrong for sampled.

        if gate.drafting(running, sampled): ...draft...
        gate.observe(running, drafting, tokens_emitted, step_seconds, sampled)   # decode-only steps

    Pure bookkeeping (the caller times the steps), so a test can drive it with any timings."""

    def __init__(self, epoch_steps: int = GATE_EPOCH_STEPS, explore_every: int = GATE_EXPLORE_EVERY):
        self.epoch_steps = max(1, epoch_steps)
        self.explore_every = max(2, explore_every)
        self._buckets: dict[int, _GateBucket] = {}

    @staticmethod
    def bucket(concurrency: int) -> int:
        return max(1, concurrency).bit_length()

    def _state(self, concurrency: int, sampled: bool = False) -> _GateBucket:
        key = (self.bucket(concurrency), sampled)
        st = self._buckets.get(key)
        if st is None:
            st = self._buckets[key] = _GateBucket()
        return st

    def drafting(self, concurrency: int, sampled: bool = False) -> bool:
        return self._state(concurrency, sampled).drafting

    def observe(self, concurrency: int, drafting: bool, tokens: int, seconds: float, sampled: bool = False) -> None:
        """One decode step of the bucket, in mode `drafting` (a step of the other mode, from a bucket's
        switch between a step's draft and its timing, is dropped), that emitted `tokens` in `seconds`;
        `sampled`: most of the step's decoding sequences sample (temperature > 0)."""
        st = self._state(concurrency, sampled)
        if drafting != st.drafting or seconds <= 0:
            return
        st.steps += 1
        # per running sequence: a bucket spans up to 2x in batch size, and an epoch at the top of it would
        # otherwise out-run one at the bottom whatever the mode
        st.tokens += tokens / max(1, concurrency)
        st.seconds += seconds
        if st.steps < self.epoch_steps:
            return
        rate = st.tokens / st.seconds
        old = st.rate.get(st.drafting)
        st.rate[st.drafting] = rate if old is None else old + GATE_ALPHA * (rate - old)
        st.epochs += 1
        st.steps, st.tokens, st.seconds = 0, 0.0, 0.0
        if len(st.rate) < 2:  # measure the mode not yet seen
            st.drafting = not st.drafting
            return
        best = st.rate[True] >= st.rate[False]
        if st.exploring:
            st.confirmed = min(st.confirmed + 1, GATE_BACKOFF_MAX) if st.drafting != best else 0
        if st.exploring or not st.next_explore:
            hi, lo = max(st.rate.values()), min(st.rate.values())
            wait = self.explore_every * (GATE_CLEAR_SLOWER if hi >= GATE_CLEAR_RATIO * lo else 1) << st.confirmed
            st.next_explore = st.epochs + wait - 1  # the re-try is the wait's last epoch
        st.exploring = st.epochs >= st.next_explore
        st.drafting = (not best) if st.exploring else best

    def snapshot(self) -> dict:
        """{bucket's lowest concurrency (greedy batches) or "<it> sampled": {"drafting": mode now, "on": tok/s,
        "off": tok/s}} for /stats (tokens per second per running sequence)."""
        return {(1 << (b - 1) if not sampled else f"{1 << (b - 1)} sampled"):
                {"drafting": st.drafting, "on": st.rate.get(True), "off": st.rate.get(False)}
                for (b, sampled), st in sorted(self._buckets.items())}
