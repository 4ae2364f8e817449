"""Next-token sampling for a whole batch at once, on the device (`xp`), so 262k-entry logit rows never
travel to the host: only the chosen ids (and asked-for logprobs) do.

One rule for every row: the token is the argmax of `logits / T + g`, where g is Gumbel noise drawn from a
counter-based generator keyed by (the request's seed, the token's index) and the vocabulary id (the
Gumbel-max trick: that argmax is distributed exactly as softmax(logits / T)). Greedy rows (T = 0) take
the plain argmax. So a draw needs no sort and no cumulative sum, the same pass serves greedy and sampled
rows, and a seeded request gives the same tokens whatever else shares its batch, after a preemption, and
with or without speculation (verification recomputes the very same draw at each drafted position:
rng.py). top-k / top-p / min-p first mask the row to its kept tokens (thresholds below), then the same
rule picks among them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from workers.cupy.rng import NOISE_MAX, gumbel
from workers.protocol import SamplingParams, TokenLogprob

# Rows keep their top CANDIDATES probabilities, sorted, to find top-k / top-p thresholds without sorting
# the whole vocabulary; a row whose nucleus is wider than that falls back to a full sort.
CANDIDATES = 1024


@dataclass
class SampleRow:
    params: SamplingParams
    key: tuple[int, int] = (0, 0)  # rng.row_key(seed, token index): this token's draw
    logprobs: int | None = None  # None: not asked; N: the chosen token's logprob and N alternatives

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def inv_temperature(self) -> float:
        return 0.0 if self.greedy else 1.0 / self.params.temperature

    @property
    def truncated(self) -> bool:
        """Sampled with top-k, top-p or min-p: the row is masked before the draw."""
        return truncated(self.params)


def truncated(params: SamplingParams) -> bool:
    """A row with these params is sampled with top-k, top-p or min-p (masked before the draw)."""
    return not params.greedy and (params.top_k > 1 or params.top_p < 1.0 or params.min_p > 0.0)


# What a row asks beyond the plain draw (bits of row_asks, and of SampleRows.asks for a whole step): each is a
# request's setting, so a sequence's bits are fixed for its life (engine.row_constants keeps them).
ASK_LOGPROBS = 1  # its chosen token's logprob
ASK_ALTERNATIVES = 2  # top alternatives besides (logprobs > 0)
ASK_TRUNCATED = 4  # top-k / top-p / min-p: the row is masked before the draw
ASK_PENALIZED = 8  # presence / frequency penalties


def row_asks(params: SamplingParams, logprobs: int | None) -> int:
    """The ASK_* bits of a row with these sampling params and logprobs ask (SampleRow's properties' rules)."""
    return ((logprobs is not None) * ASK_LOGPROBS | ((logprobs or 0) > 0) * ASK_ALTERNATIVES
            | truncated(params) * ASK_TRUNCATED | params.penalized * ASK_PENALIZED)


def rows_ask(rows, bits: int) -> bool:
    """Whether any of `rows` asks for any of `bits`: SampleRows' one number for the step, else row by row."""
    asks = getattr(rows, "asks", None)
    if asks is not None:
        return bool(asks & bits)
    return any(row_asks(r.params, r.logprobs) & bits for r in rows)


class SampleRows(Sequence):
    """A step's rows (SampleRow each) with their draw parameters already packed for the device (pack_rows'
    layout) and what any of them asks beyond a plain draw (`asks`, ASK_* bits), built together in one vectorized
    pass (Engine.sample_rows): staging a step copies one array instead of reading every row's key and
    temperature again (~0.5 ms a step at 256 rows on the dev box), and a step of plain draws is known as one
    without reading a row. The SampleRow objects themselves are made only when a row is read (a plain
    overlapped step on the GPU reads none: ~64 us a step at 256 rows saved)."""

    __slots__ = ("sources", "lo", "hi", "packed", "asks", "_rows")

    def __init__(self, sources: list, lo: np.ndarray, hi: np.ndarray, packed: np.ndarray, asks: int):
        # sources: each row's sequence (anything with `sampling` and `logprobs`), read only when a row is: the two
        # lists of a row's params and logprobs ask were ~20 us a step at 256 rows, on a step that reads no row
        self.sources, self.lo, self.hi = sources, lo, hi
        self.packed, self.asks, self._rows = packed, asks, None

    def _list(self) -> list[SampleRow]:
        if self._rows is None:
            self._rows = [SampleRow(s.sampling, key, s.logprobs)
                          for s, key in zip(self.sources, zip(self.lo.tolist(), self.hi.tolist()))]
        return self._rows

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())


def pack_rows(rows, out: np.ndarray) -> None:
    """The device draw's parameters of `rows` into `out` ((len(rows), 4) int32, what the step's argmax kernel
    reads, gpu/sampling.cu): the key's two words, 1/T as float32 bits (0: greedy), logprob wanted (0/1)."""
    packed = getattr(rows, "packed", None)
    if packed is not None:
        out[...] = packed
        return
    n = len(rows)
    keys = np.fromiter(chain.from_iterable(r.key for r in rows), np.uint32, 2 * n).reshape(n, 2)
    out[:, :2] = keys.view(np.int32)
    out[:, 2] = np.fromiter((r.inv_temperature for r in rows), np.float32, n).view(np.int32)
    out[:, 3] = np.fromiter((r.logprobs is not None for r in rows), np.int32, n)


def packed_rows(sources: list, lo: np.ndarray, hi: np.ndarray, like: np.ndarray, asks: int) -> SampleRows:
    """SampleRows for rows of these sequences (`sources`: their sampling params and logprobs asks) and key words
    (rng.index_keys), packed as they are built: `like` holds the rows' temperature and logprob columns (pack_rows'
    layout; Engine.sample_rows fills them from each sequence's row constants), `asks` what the rows ask (the OR of
    their row_asks). `sources` is kept, not copied: the caller does not change it afterwards."""
    packed = like.copy()
    packed[:, 0] = lo.view(np.int32)
    packed[:, 1] = hi.view(np.int32)
    return SampleRows(sources, lo, hi, packed, asks)


class Sampler:
    def __init__(self, xp, candidates: int = CANDIDATES):
        self.xp = xp
        self.candidates = candidates

    def stage(self, rows: list[SampleRow]) -> None:
        """The coming step's rows, one per logits row, before its forward (a device sampler draws inside
        the step); nothing to do here."""

    def hold(self, logits, rows: list[SampleRow]):
        """A step's draws for the step launched after it before they are read (engine.py, overlap): (the ids
        as the next step's inputs take them, a callable returning sample()'s result once it is ready), or None
        where the draws cannot be held. Here the draw is made at once; a device sampler only starts copying
        its in-step draws back (workers/cupy/gpu GpuSampler)."""
        tokens, logprobs = self.sample(logits, rows)
        return tokens.astype(np.int32), lambda: (tokens, logprobs)

    def sample(self, logits, rows: list[SampleRow], index=None) -> tuple[np.ndarray, list]:
        """Chosen token per row (host int64 array) and, per row, its logprob entry when asked.

        `index`: when given, `logits` are the whole step's rows and these rows are `logits[index]`."""
        if index is not None:
            logits = logits[self.xp.asarray(np.asarray(index))]
        masked = self.mask_truncated(logits, rows)
        tokens = self.choose(masked, rows)
        return tokens, self._logprobs(logits, tokens, rows)

    def mask_truncated(self, logits, rows: list[SampleRow]):
        """`logits` with every truncated row's dropped tokens at -inf (a copy when any row is truncated)."""
        xp = self.xp
        if not rows_ask(rows, ASK_TRUNCATED):
            return logits
        cut = [i for i, r in enumerate(rows) if r.truncated]
        if not cut:
            return logits
        sel = xp.asarray(np.asarray(cut))
        sub = [rows[i] for i in cut]
        kept = self.truncated_probs(logits[sel], sub, np.array([r.params.temperature for r in sub], np.float32))
        out = logits.copy()
        out[sel] = xp.where(kept > 0, logits[sel], -np.inf)
        return out

    def choose(self, logits, rows: list[SampleRow]) -> np.ndarray:
        """Gumbel-max per row (module docstring), host int64. On NumPy only the tokens that can still win
        get noise: the noise is bounded above by NOISE_MAX, so a token whose scaled logit is below the best
        one's score minus that bound never wins (exact, and ~100x less hashing than the whole row)."""
        xp = self.xp
        if xp is not np:
            return self._choose_dense(logits, rows)
        out = np.argmax(logits, axis=1).astype(np.int64)
        for i, r in enumerate(rows):
            if r.greedy:
                continue
            s = logits[i] * np.float32(r.inv_temperature)
            j0 = int(out[i])
            best = s[j0] + gumbel(np, np.array([j0], np.uint32), r.key)[0]
            if not np.isfinite(best):  # the top token drew the -inf end of the noise: score every token
                cand = np.arange(s.size, dtype=np.uint32)
            else:
                cand = np.flatnonzero(s >= best - np.float32(NOISE_MAX)).astype(np.uint32)
            scores = s[cand] + gumbel(np, cand, r.key)
            out[i] = int(cand[int(np.argmax(scores))])
        return out

    def _choose_dense(self, logits, rows: list[SampleRow]) -> np.ndarray:
        """The same draw for every row at once (array modules other than NumPy)."""
        xp = self.xp
        inv_t = xp.asarray(np.array([r.inv_temperature for r in rows], np.float32))[:, None]
        ids = xp.arange(logits.shape[1], dtype=xp.uint32)
        noise = xp.stack([gumbel(xp, ids, r.key) for r in rows])
        scores = xp.where(inv_t > 0, logits * inv_t + noise, logits)
        tokens = xp.argmax(scores, axis=1)
        return (tokens.get() if hasattr(tokens, "get") else np.asarray(tokens)).astype(np.int64)

    def truncated_probs(self, logits, rows: list[SampleRow], temps: np.ndarray):
        """Per row, the distribution a draw samples from (temperature, then top-k/top-p/min-p), not
        renormalised."""
        xp = self.xp
        scaled = logits / xp.asarray(temps)[:, None]
        probs = xp.exp(scaled - scaled.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        threshold = xp.asarray(self._thresholds(probs, rows))
        return xp.where(probs >= threshold[:, None], probs, 0)

    def _thresholds(self, probs, rows: list[SampleRow]):
        """Per row, the smallest probability kept after top-k, top-p and min-p."""
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
        if not rows_ask(rows, ASK_LOGPROBS):
            return out
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
