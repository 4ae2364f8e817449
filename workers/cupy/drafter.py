"""Draft tokens for speculative decoding, without a draft model: prompt lookup (n-gram matching) and
OpenAI Predicted Outputs.

Prompt lookup: the last n tokens of the sequence (prompt + generated) are searched for earlier in the
sequence, longest n first; the tokens that followed the most recent earlier occurrence are the draft.
Agents rewrite files, quote tool results and repeat identifiers, so the continuation is often already in
the context; when nothing matches, there is no draft and the step costs what plain decoding costs.
Once a draft came from somewhere, the next one continues from the same place for as long as the tokens
the sequence took since are the ones found there (a file being copied out is walked, not searched for
again): no search on most steps of a copy, and no jump to a later copy of a repeated line mid-walk.

Predicted Outputs: the request's `prediction_ids` (e.g. the file being edited) is searched first. The
output usually walks the prediction from start to end with small edits, so among the places the suffix
matches, the first one at or after where the previous draft came from wins (a repeated line further
back is the wrong copy); before any output, the draft is the prediction's first tokens.
"""
from __future__ import annotations

from difflib import SequenceMatcher

import numpy as np

MAX_NGRAM = 8  # longest suffix tried: long matches pick the right copy of a repeated line
MIN_NGRAM = 2  # a one-token match proposes noise more often than not


def longest_matches(haystack: np.ndarray, tail: np.ndarray, max_n: int, min_n: int) -> tuple[int, np.ndarray]:
    """(n, starts): the longest n in [min_n, max_n] for which tail's last n tokens occur in `haystack` with at
    least one token after them, and where each such occurrence's next token is (ascending); (0, empty) if none.
    The same answer as comparing every window of each length n in turn, from max_n down (the search this replaced,
    kept as the oracle of tests/unit/test_drafter.py), in one pass over the haystack: only the places holding tail's
    last token are candidates (few in text), and their match runs backwards are extended together, one comparison a
    step back (the per-length search cost ~0.4 ms a step at 1,500 tokens of novel text on the dev box)."""
    max_n = min(max_n, tail.size, haystack.size - 1)
    if max_n < min_n or max_n < 1:
        return 0, np.empty(0, np.int64)
    ends = np.flatnonzero(haystack[:-1] == tail[-1])  # a match's last token; one follows it
    n = 1
    while ends.size and n < max_n:
        before = ends - n
        ok = before >= 0
        ok[ok] = haystack[before[ok]] == tail[-1 - n]
        if not ok.any():
            break
        ends = ends[ok]  # those that match n + 1 tokens
        n += 1
    if n < min_n or not ends.size:
        return 0, np.empty(0, np.int64)
    return n, ends + 1


class Drafter:
    """One sequence's drafter. `propose(tokens, k)` is called with the sequence's tokens so far."""

    def __init__(self, prediction: list[int] | None = None, num_prompt_tokens: int = 0,
                 max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.prediction = np.asarray(prediction or [], np.int64)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._buf = np.empty(256, np.int64)  # the sequence's tokens, grown in place (no per-step copy)
        self._len = 0
        self._pred_pos = 0  # where in the prediction the previous draft started
        # prompt lookup: (where in the sequence the previous draft started, the sequence's length then)
        self._walk: tuple[int, int] | None = None

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (empty when nothing matches)."""
        if k <= 0:
            return []
        ctx = self._sync(tokens)
        if self.prediction.size:
            draft = self._from_prediction(ctx, k)
            if draft:
                return draft
        return self._from_context(ctx, k)

    def _sync(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self._len:  # never happens while a sequence only grows; rebuild rather than trust the buffer
            self._len = 0
        if n > self._buf.size:
            grown = np.empty(max(n, 2 * self._buf.size), np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : n] = tokens[self._len : n]
        self._len = n
        return self._buf[:n]

    def _from_prediction(self, ctx: np.ndarray, k: int) -> list[int]:
        pred = self.prediction
        generated = ctx.size - self.num_prompt_tokens
        if generated <= 0:
            self._pred_pos = 0
            return pred[:k].tolist()
        n, starts = longest_matches(pred, ctx, min(self.max_ngram, generated), self.min_ngram)
        if n:  # starts: where each match's continuation starts
            ahead = starts[starts >= self._pred_pos]
            pos = int(ahead[0]) if ahead.size else int(starts[-1])
            self._pred_pos = pos
            return pred[pos : pos + k].tolist()
        return []

    def _from_context(self, ctx: np.ndarray, k: int) -> list[int]:
        if self._walk is not None:  # the tokens taken since the last draft: still the ones where it came from?
            src, then = self._walk
            taken = ctx.size - then
            pos = src + taken
            if 0 < taken and pos < ctx.size and np.array_equal(ctx[src:pos], ctx[then:]):
                self._walk = (pos, ctx.size)
                return ctx[pos : pos + k].tolist()
        self._walk = None
        # the suffix itself ends the sequence, so it has no following token and is never matched
        n, starts = longest_matches(ctx, ctx, self.max_ngram, self.min_ngram)  # it caps n at ctx.size - 1
        if n:
            pos = int(starts[-1])
            self._walk = (pos, ctx.size)
            return ctx[pos : pos + k].tolist()
        return []


def prediction_usage(prediction: list[int], completion: list[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens in OpenAI's sense: the prediction's tokens that appear, in
    order, in the completion (the matching blocks of a diff), and the rest of the prediction. A prediction
    the completion reproduces exactly is all accepted, however many of its tokens were drafted."""
    if not prediction:
        return 0, 0
    matched = sum(b.size for b in SequenceMatcher(None, prediction, completion, autojunk=False).get_matching_blocks())
    return matched, len(prediction) - matched
