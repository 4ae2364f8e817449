"""Speculation depth K: a pure function of what the worker sees at one decode step.

The worker calls `choose_k` for every decoding sequence at every step, with its live occupancy (the
sequences running in its batch now). A proxy in front of llama-server could only count its own requests,
so it was one request late at the start of a burst; the worker knows its batch exactly.

The device profile's `speculation` table is read top to bottom and the first rule that holds wins: a rule
holds when the context is below its `max_context`, the concurrency is at or below its `max_concurrency`
and, if the rule names a workload class, the sequence is of that class. No rule: K = 0. The profile's
`max_draft_tokens` caps every rule; a request's own `max_draft_tokens` may lower K further (0 disables
speculation for it) and can never raise it.
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
