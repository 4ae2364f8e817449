"""Next-token sampling for a whole batch at once, on the device (`xp`), so 262k-entry logit rows never
travel to the host: only the chosen ids (and asked-for logprobs) do.

Truncation is by thresholds, vectorised over rows: each row gets the smallest probability it keeps
(top-k: the k-th largest; top-p: the last one of the nucleus, measured after top-k; min-p: min_p times
the largest) and one inverse-CDF draw picks among the tokens at or above it. The draw's uniform number
comes from the request's own generator keyed by (seed, token index), so a seeded request gives the
same tokens whatever else shares its batch, and after a preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workers.protocol import SamplingParams, TokenLogprob

# Rows keep their top CANDIDATES probabilities, sorted, to find top-k / top-p thresholds without sorting
# the whole vocabulary; a row whose nucleus is wider than that falls back to a full sort.
CANDIDATES = 1024


@dataclass
class SampleRow:
    params: SamplingParams
    uniform: float  # the draw in [0, 1) for this token
    logprobs: int | None = None  # None: not asked; N: the chosen token's logprob and N alternatives


def uniform_for(seed: int | None, token_index: int, rng: np.random.Generator) -> float:
    """The request's draw for its `token_index`-th generated token: reproducible when seeded."""
    if seed is None:
        return float(rng.random())
    return float(np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, token_index]).random())


class Sampler:
    def __init__(self, xp, candidates: int = CANDIDATES):
        self.xp = xp
        self.candidates = candidates

    def sample(self, logits, rows: list[SampleRow]) -> tuple[np.ndarray, list[list[TokenLogprob] | None]]:
        """Chosen token per row (host int64 array) and, per row, its logprob entry when asked."""
        xp = self.xp
        tokens = xp.argmax(logits, axis=1)
        temps = np.array([r.params.temperature for r in rows], np.float32)
        greedy = (temps <= 0) | (np.array([r.params.top_k for r in rows]) == 1)
        stochastic = np.flatnonzero(~greedy)
        if stochastic.size:
            sel = xp.asarray(stochastic)
            tokens[sel] = self._draw(logits[sel], [rows[i] for i in stochastic], temps[stochastic])
        host_tokens = tokens.get() if hasattr(tokens, "get") else np.asarray(tokens)
        return host_tokens.astype(np.int64), self._logprobs(logits, host_tokens, rows)

    def _draw(self, logits, rows: list[SampleRow], temps: np.ndarray):
        xp = self.xp
        kept = self.truncated_probs(logits, rows, temps)
        cdf = xp.cumsum(kept, axis=1)
        target = xp.asarray(np.array([r.uniform for r in rows], np.float32))[:, None] * cdf[:, -1:]
        return xp.minimum((cdf <= target).sum(axis=1), kept.shape[1] - 1)

    def truncated_probs(self, logits, rows: list[SampleRow], temps: np.ndarray):
        """Per row, the distribution a draw samples from (temperature, then top-k/top-p/min-p), not
        renormalised; speculation's rejection sampling uses it as the target distribution."""
        xp = self.xp
        scaled = logits / xp.asarray(temps)[:, None]
        probs = xp.exp(scaled - scaled.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        threshold = xp.asarray(self._thresholds(probs, rows))
        return xp.where(probs >= threshold[:, None], probs, 0)

    def _thresholds(self, probs, rows: list[SampleRow]):
        """Per row, the smallest probability kept after top-k, top-p and min-p."""
        xp = self.xp
        vocab = probs.shape[1]
        top_k = np.array([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows])
        top_p = np.array([r.params.top_p for r in rows], np.float32)
        min_p = np.array([r.params.min_p for r in rows], np.float32)
        width = min(vocab, max(self.candidates, int(top_k[top_k < vocab].max(initial=0))))
        if np.all((top_k == vocab) & (top_p >= 1.0)):
            width = 1  # only min-p (or nothing) to apply: the largest probability is all it needs
        top = self._sorted_top(probs, width)
        k_cols = np.minimum(top_k, width)
        has_k = top_k < vocab
        top_in_k = np.where(np.arange(width)[None, :] < k_cols[:, None], top, 0)
        # top-p is measured on the distribution left after top-k (renormalised); without top-k the
        # candidates are a part of a distribution that sums to 1
        cum = np.cumsum(top_in_k, axis=1) / np.where(has_k, top_in_k.sum(axis=1), 1.0)[:, None]
        reached = cum[:, -1] >= top_p - 1e-6
        if np.any((top_p < 1.0) & ~reached & (width < vocab)):  # a flat row: the nucleus is wider
            return self._thresholds_full(probs, rows)
        nucleus_end = np.where(reached, np.argmax(cum >= top_p[:, None] - 1e-6, axis=1), width - 1)
        rows_idx = np.arange(len(rows))
        threshold = np.where(has_k, top[rows_idx, np.maximum(k_cols - 1, 0)], 0.0)
        threshold = np.where(top_p < 1.0, np.maximum(threshold, top[rows_idx, nucleus_end]), threshold)
        return np.maximum(threshold, min_p * top[:, 0]).astype(np.float32)

    def _thresholds_full(self, probs, rows):
        saved, self.candidates = self.candidates, probs.shape[1]
        try:
            return self._thresholds(probs, rows)
        finally:
            self.candidates = saved

    def _sorted_top(self, probs, width: int) -> np.ndarray:
        """The `width` largest probabilities of each row, largest first, on the host (small)."""
        xp = self.xp
        vocab = probs.shape[1]
        part = probs if width == vocab else xp.partition(probs, vocab - width, axis=1)[:, vocab - width :]
        top = -xp.sort(-part, axis=1)
        return top.get() if hasattr(top, "get") else np.asarray(top)

    def _logprobs(self, logits, tokens: np.ndarray, rows: list[SampleRow]):
        """The model's own log-probabilities (before temperature), for rows that asked."""
        xp = self.xp
        out: list[list[TokenLogprob] | None] = [None] * len(rows)
        for i, r in enumerate(rows):
            if r.logprobs is None:
                continue
            row = logits[i]
            m = row.max()
            logp = row - (m + xp.log(xp.exp(row - m).sum()))
            top = []
            if r.logprobs > 0:
                idx = xp.argpartition(-logp, r.logprobs)[: r.logprobs]
                idx = idx[xp.argsort(-logp[idx])]
                ids = idx.get() if hasattr(idx, "get") else np.asarray(idx)
                vals = logp[idx].get() if hasattr(idx, "get") else np.asarray(logp[idx])
                top = [(int(t), float(v)) for t, v in zip(ids, vals)]
            out[i] = [TokenLogprob(token_id=int(tokens[i]), logprob=float(logp[int(tokens[i])]), top=top)]
        return out
