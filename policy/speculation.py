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
"""
from __future__ import annotations

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

    def __init__(self, width: int = 16):
        self.rates = [PRIOR] * width
        self.idle = 0  # steps since this sequence last drafted because its estimate said no

    def update(self, drafted: int, kept: int) -> None:
        """A verified draft: positions 1..kept were kept, position kept+1 (if drafted) was rejected;
        positions after that say nothing."""
        for i in range(min(drafted, kept + 1, len(self.rates))):
            hit = 1.0 if i < kept else 0.0
            self.rates[i] += ALPHA * (hit - self.rates[i])

    def expected_kept(self, k: int) -> float:
        """Expected drafts kept at depth k: sum over i <= k of the chance the first i are all kept."""
        total, run = 0.0, 1.0
        for r in self.rates[:k]:
            run *= r
            total += run
        return total


def tokens_per_cost(expected_kept: float, k: int, concurrency: int, draft_token_cost: float) -> float:
    """Tokens a sequence emits per unit of step cost at depth k. A step of T tokens costs
    1 + c (T - 1) batch-1 decode steps (c = draft_token_cost, per device); a sequence's share of a
    batch of `concurrency` is that cost over the batch, plus c for each of its own drafts."""
    b = max(concurrency, 1)
    share = (1.0 + draft_token_cost * (b - 1)) / b + draft_token_cost * k
    return (1.0 + expected_kept) / share


def choose_depth(cap: int, acceptance: Acceptance, concurrency: int, draft_token_cost: float) -> int:
    """The depth in 0..cap that gives the most tokens per unit of step cost under this sequence's
    estimate; 0 when no depth beats plain decoding, except a 1-token probe every PROBE_EVERY such steps."""
    if cap <= 0:
        return 0
    best, best_rate = 0, tokens_per_cost(0.0, 0, concurrency, draft_token_cost)
    for k in range(1, cap + 1):
        rate = tokens_per_cost(acceptance.expected_kept(k), k, concurrency, draft_token_cost)
        if rate > best_rate:
            best, best_rate = k, rate
    if best == 0:
        acceptance.idle += 1
        if acceptance.idle >= PROBE_EVERY:
            acceptance.idle = 0
            return 1
    else:
        acceptance.idle = 0
    return best
