"""Incremental prompt tokenization: a growing conversation pays only for its new messages.

Agents resend their whole context every turn; tokenizing a 9.4k-token chat took ~15 ms of gateway CPU per
request. HF `tokenizers` first cuts the text at its added tokens (leftmost-longest match on the raw text for
tokens with normalized=False), then normalizes, pre-tokenizes and runs the model on each piece between them
on its own. So the text between two turn markers (`<start_of_turn>`, `<end_of_turn>`, `<|im_start|>`, ...)
tokenizes the same alone as inside the whole prompt, and its ids can be cached by its text.

That holds only where our cut at a marker is the cut the library itself makes. `safe_cuts` keeps a marker
only when no other added token can swallow or cross it (no token containing it, none ending in a prefix of
it), it matches on the raw text (normalized=False, no lstrip/rstrip/single_word) and its edge characters are
neither whitespace nor word characters (so a neighbour's lstrip/rstrip/single_word sees the same thing at the
cut as in the whole text); and the pipeline has no step that looks at a piece's place in the whole text
(Metaspace with prepend_scheme "first"), no truncation or padding, and special tokens are extracted. A probe
compares both ways once. Where any check fails, the tokenizer is used on the whole text, as before.
"""
from __future__ import annotations

import json
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable

DEFAULT_CACHE_BYTES = 64 << 20
_INT_BYTES = 28  # a Python int object holding a token id (ids < 256 are shared, so this over-counts)


def safe_cuts(tok, candidates: Iterable[str]) -> list[str]:
    """The candidate added tokens at which `tok`'s own pipeline is known to cut every occurrence."""
    if not _pipeline_is_piece_local(tok):
        return []
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    return sorted({c for c in candidates if c in added and _cut_is_safe(added[c], added)})


def _pipeline_is_piece_local(tok) -> bool:
    if tok.encode_special_tokens or tok.truncation is not None or tok.padding is not None:
        return False
    for part in (tok.normalizer, tok.pre_tokenizer):
        if part is not None and _has_first_only_prefix(json.loads(part.__getstate__())):
            return False
    return True


def _has_first_only_prefix(node) -> bool:
    """Metaspace(prepend_scheme="first") adds its prefix only at offset 0 of the whole text: not piece-local."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return True
        return any(_has_first_only_prefix(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_first_only_prefix(v) for v in node)
    return False


def _cut_is_safe(token, added: dict) -> bool:
    c = token.content
    if token.normalized or token.lstrip or token.rstrip or token.single_word:
        return False
    if any(ch.isspace() or re.match(r"\w", ch) for ch in (c[0], c[-1])):
        return False
    prefixes = [c[:k] for k in range(1, len(c))]
    for other, t in added.items():
        # normalized tokens are matched later, inside the pieces between raw-text matches: they cannot cross c
        if other == c or t.normalized:
            continue
        # `other` could win the leftmost-longest match over c's first characters, or contain c outright
        if c in other or any(len(other) > len(p) and other.endswith(p) for p in prefixes):
            return False
    return True


class PieceTokenizer:
    """`encode(text)` equal to `tok.encode(text, add_special_tokens=False).ids`, reusing cached pieces.

    The cache is an LRU bounded by an estimate of its bytes (piece text + ids), shared by every request of
    one gateway; it is guarded by a lock because requests may be tokenized on executor threads.
    """

    def __init__(self, tok, cut_tokens: Iterable[str], *, max_bytes: int = DEFAULT_CACHE_BYTES):
        self._tok = tok
        self.max_bytes = max_bytes
        cuts = safe_cuts(tok, cut_tokens)
        self._cut_ids = {c: tok.token_to_id(c) for c in cuts}
        self._split = re.compile("(" + "|".join(re.escape(c) for c in cuts) + ")") if cuts else None
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = 0
        if self._split is not None and not self._probe_agrees(cuts):
            self._split = None

    @property
    def incremental(self) -> bool:
        return self._split is not None

    @property
    def cuts(self) -> list[str]:
        return list(self._cut_ids) if self._split is not None else []

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._whole(text)
        out: list[int] = []
        # re.split with one group alternates: piece, marker, piece, marker, ..., piece
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._cut_ids[part])
            elif part:
                out.extend(self._piece(part))
        return out

    def _whole(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def piece(self, text: str) -> tuple[int, ...]:
        """One piece's ids (text the caller already cut at markers), from the cache when seen before."""
        return self._piece(text)

    def _piece(self, text: str) -> tuple[int, ...]:
        with self._lock:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return ids
            self.misses += 1
        ids = tuple(self._whole(text))  # outside the lock: other requests' hits need not wait for it
        size = _entry_bytes(text, ids)
        if size > self.max_bytes:
            return ids
        with self._lock:
            if text not in self._cache:
                self._cache[text] = ids
                self.bytes += size
            while self.bytes > self.max_bytes:
                old_text, old_ids = self._cache.popitem(last=False)
                self.bytes -= _entry_bytes(old_text, old_ids)
        return ids

    def __len__(self) -> int:
        return len(self._cache)

    def _probe_agrees(self, cuts: list[str]) -> bool:
        """One end-to-end check with the markers against text, spaces, newlines and each other."""
        probe = "".join(f"a {c} b\n{c}{c}\n\n {c}x" for c in cuts) + " é 日本\t"
        agrees = self.encode(probe) == self._whole(probe)
        self._cache.clear()
        self.bytes = self.hits = self.misses = 0
        return agrees


def _entry_bytes(text: str, ids: tuple[int, ...]) -> int:
    return sys.getsizeof(text) + sys.getsizeof(ids) + _INT_BYTES * len(ids)
