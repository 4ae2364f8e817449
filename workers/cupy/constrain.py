"""Grammar-constrained decoding: one llguidance matcher per constrained sequence, and the allowed-token
mask applied to the step's logits on the device (`xp`) before sampling.

Why llguidance: on the 2-core box, with the bundled 262,144-token Gemma 3 vocabulary, it compiled a JSON
schema in ~1 ms (xgrammar ~200 ms, outlines-core ~2 s and ~60 s for "any object") and computed a step's
mask in ~20 µs median; it needs no torch (xgrammar does); and its matchers roll back, which speculation
needs (BENCHMARKS.md, "Constrained decoding", has the figures and commands).

The grammar a request carries (GenerateRequest.grammar) is a JSON schema as text: the same text
llama-server's `json_schema` takes, so both backends enforce one thing.

Per step: the host computes a packed bitmask (1 bit per token, 32 KiB per row) for the constrained rows
only; that is what crosses to the device, where it is unpacked and the disallowed logits are pushed to
a very negative finite value (not -inf: logprobs stay finite JSON numbers, and temperature scaling
cannot make inf - inf).
"""
from __future__ import annotations

import collections
import json
import threading

import llguidance as llg
import numpy as np

from workers.protocol.model import release_freed_heap

# How JSON is laid out: one space after ':' and ',' (what the model writes unconstrained, so it stays in
# its own distribution), no free whitespace (a constrained model can otherwise pad forever).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on what one schema may cost to build and to step (llguidance's own fuel and size limits).
LIMITS = dict(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=2_000_000,
              step_lexer_fuel=500_000, step_max_items=100_000)
MASKED = -1e30  # logit for a disallowed token (float32); see the module docstring for why not -inf


class GrammarError(ValueError):
    """The schema cannot be compiled; the message says why (a client error)."""


def grammar_from_schema(schema_text: str) -> str:
    """llguidance's grammar for a JSON schema given as JSON text; GrammarError when it is not one."""
    try:
        schema = json.loads(schema_text)
    except ValueError as e:
        raise GrammarError(f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None


class GrammarCompiler:
    """Compiles schemas against the model's vocabulary, once per schema (LRU cache of pristine matchers).

    The vocabulary index takes ~10 s to build for 262k tokens, so it is built in a background thread from
    construction on; `prepare()` waits for it, and is meant to be called off the engine thread (the
    backend's `generate` does it in a worker thread) so the step loop never waits on it.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256):
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        self._cache: collections.OrderedDict[str, llg.LLMatcher] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._lltok: llg.LLTokenizer | None = None
        self._error: Exception | None = None
        self._limits = llg.LLParserLimits(**LIMITS)
        args = (tokenizer.to_str(), vocab_size, list(eos_token_ids))
        threading.Thread(target=self._build, args=args, name="grammar-vocab", daemon=True).start()

    def _build(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        try:
            self._lltok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # surfaced to every constrained request rather than killing the worker
            self._error = e
        finally:
            self._ready.set()
        # the index's build freed most of what it allocated (parsing Gemma 3's 32 MB tokenizer.json), which the
        # process keeps for the life of the worker unless handed back, on boxes where it is also the GPU's
        release_freed_heap()

    def ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def prepare(self, schema_text: str, timeout: float = 120.0) -> None:
        """Compile (or find cached) `schema_text`; GrammarError when it cannot be compiled."""
        self.matcher(schema_text, timeout)

    def matcher(self, schema_text: str, timeout: float = 120.0) -> llg.LLMatcher:
        """A fresh matcher for one sequence (a copy of the cached, compiled one)."""
        with self._lock:
            base = self._cache.get(schema_text)
            if base is not None:
                self._cache.move_to_end(schema_text)
                return base.deep_copy()
        if not self._ready.wait(timeout):
            raise RuntimeError("the grammar vocabulary index is still building")
        if self._lltok is None:
            raise RuntimeError(f"the grammar vocabulary index failed to build: {self._error}")
        base = llg.LLMatcher(self._lltok, grammar_from_schema(schema_text), log_level=0, limits=self._limits)
        if base.is_error():
            raise GrammarError(base.get_error())
        with self._lock:
            self._cache[schema_text] = base
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return base.deep_copy()


class Constraints:
    """The engine's constrained sequences, by request id; `apply` masks a step's logits, `advance` feeds
    the sampled tokens back. Used from the engine thread only."""

    def __init__(self, compiler: GrammarCompiler, xp):
        self.compiler, self.xp = compiler, xp
        self._matchers: dict[str, llg.LLMatcher] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def attach(self, request_id: str, schema_text: str) -> None:
        self._matchers[request_id] = self.compiler.matcher(schema_text)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def apply(self, logits, request_ids: list[str]):
        """`logits` (rows in `request_ids` order) with each constrained row's disallowed tokens masked."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return logits
        bitmask = np.full((len(rows), (self.compiler.vocab_size + 31) // 32), -1, np.int32)
        for j, i in enumerate(rows):
            self._fill(self._matchers[request_ids[i]], bitmask[j])
        return apply_bitmask(self.xp, logits, rows, bitmask)

    def apply_drafts(self, logits, request_ids: list[str], drafts: dict[str, list[int]]):
        """Speculation's verification rows: a sequence with an m-token draft has m + 1 consecutive rows
        (its id repeated in `request_ids`); row i of a constrained one is masked as the grammar stands
        after the draft's first i tokens, so acceptance and the correction token both obey it."""
        rows, masks, i = [], [], 0
        while i < len(request_ids):
            rid = request_ids[i]
            width = len(drafts[rid]) + 1
            if rid in self._matchers:
                m = self.verify_bitmasks(rid, drafts[rid])
                if len(m) < width:  # rows after a refused draft are never used (it is rejected): leave them open
                    m = np.concatenate([m, np.full((width - len(m), m.shape[1]), -1, np.int32)])
                rows += range(i, i + width)
                masks.append(m)
            i += width
        return apply_bitmask(self.xp, logits, rows, np.concatenate(masks)) if rows else logits

    def _fill(self, m: llg.LLMatcher, v: np.ndarray) -> None:
        """Write `m`'s mask into the packed row `v`."""
        if m.is_error():  # a refused token (a draw at the very edge of the CDF): only end-of-sequence left
            v[:] = 0
            for t in self.compiler.eos_token_ids:
                v[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        else:
            m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    def advance(self, request_ids: list[str], tokens) -> None:
        for rid, token in zip(request_ids, tokens):
            m = self._matchers.get(rid)
            if m is not None:
                m.consume_token(int(token))  # False (error state) only for a refused token: see apply

    def cut_drafts(self, request_id: str, draft_ids: list[int]) -> int:
        """How many leading draft tokens the sequence's grammar allows (all of them when unconstrained).

        For speculation: drafts past this count are cut before verification. The matcher is left where it
        was (the verified tokens are fed through `advance` as usual)."""
        m = self._matchers.get(request_id)
        return len(draft_ids) if m is None else allowed_prefix(m, draft_ids)

    def verify_bitmasks(self, request_id: str, draft_ids: list[int]) -> np.ndarray:
        """For verifying drafts: the packed mask at each position (before draft 1, after draft 1, ...) for
        the drafts the grammar allows, shape (allowed + 1, words); apply them to the verify rows'
        logits with `apply_bitmask`. Call `cut_drafts` first; the matcher is left where it was."""
        m = self._matchers[request_id]
        n = allowed_prefix(m, draft_ids)
        out = np.zeros((n + 1, (self.compiler.vocab_size + 31) // 32), np.int32)
        for i in range(n + 1):
            self._fill(m, out[i])
            if i < n:
                m.consume_token(draft_ids[i])
        m.rollback(n)
        return out


def allowed_prefix(matcher: llg.LLMatcher, draft_ids: list[int]) -> int:
    """Number of leading `draft_ids` the matcher accepts in order, without changing its state."""
    return matcher.validate_tokens(list(draft_ids))


def apply_bitmask(xp, logits, rows: list[int], bitmask: np.ndarray):
    """Mask `logits[rows]` in place with a packed (rows, words) int32 host bitmask (bit set = allowed)."""
    if xp is np:
        for j, i in enumerate(rows):
            _mask_host_row(logits[i], bitmask[j])
        return logits
    vocab = logits.shape[1]
    packed = xp.asarray((~bitmask).view(np.uint8))  # the one host->device copy: vocab/8 bytes per row
    disallowed = xp.unpackbits(packed.ravel(), bitorder="little").reshape(len(rows), -1)[:, :vocab].astype(bool)
    masked = xp.asarray(MASKED, dtype=logits.dtype)
    if len(rows) == logits.shape[0]:
        xp.copyto(logits, masked, where=disallowed)
    else:
        idx = xp.asarray(np.asarray(rows))
        logits[idx] = xp.where(disallowed, masked, logits[idx])
    return logits


def _mask_host_row(row: np.ndarray, words: np.ndarray) -> None:
    """One row on the CPU. Most JSON states allow a few tokens (between keys, in numbers) or nearly all (in
    strings); for the first, keeping the allowed values and filling the row beats a 262k-wide masked copy
    (~4x on the 2-core box)."""
    vocab = row.shape[0]
    nonzero = np.flatnonzero(words)
    if nonzero.size * 2 < words.size:
        bits = np.unpackbits(words[nonzero].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little").view(bool)
        idx = (nonzero[:, None] * 32 + np.arange(32))[bits]
        idx = idx[idx < vocab]
        keep = row[idx]
        row.fill(MASKED)
        row[idx] = keep
    else:
        disallowed = np.unpackbits((~words).view(np.uint8), bitorder="little")[:vocab].view(bool)
        np.copyto(row, np.float32(MASKED), where=disallowed)
