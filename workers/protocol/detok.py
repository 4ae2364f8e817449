"""Token ids to streamed text: incremental detokenization and stop strings.

Shared by every backend that produces token ids itself (the engine); llama-server does its own.
"""
from __future__ import annotations

import json
import re

# decoders under which a text is its tokens' texts one after another, except where byte tokens combine into one
# character (SentencePiece's byte fallback, GPT-2's byte level): Gemma's is Replace("▁", " ") + ByteFallback +
# Fuse, SmolLM2's is ByteLevel. Others (Metaspace, Strip) treat the first token apart.
_CONCATENATIVE = {"Replace", "ByteFallback", "Fuse", "ByteLevel"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenTexts:
    """Each token's own text, where appending the token appends exactly that text to any decoded text.

    A token has one under a concatenative decoder (_CONCATENATIVE) when it decodes alone to complete
    characters (no U+FFFD) and is neither special nor a byte token; `get` is None for every other token, and
    for every token under other decoders. One per tokenizer, shared by all requests; at most one entry per
    vocabulary id.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        state = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
        kinds = {d.get("type") for d in state.get("decoders", [state])}
        self.concatenative = bool(kinds) and kinds <= _CONCATENATIVE
        self._texts: dict[int, str | None] = {}

    def get(self, token: int) -> str | None:
        try:
            return self._texts[token]
        except KeyError:
            pass
        text = None
        if self.concatenative:
            alone = self._tok.decode([token], skip_special_tokens=True)
            piece = self._tok.id_to_token(token) or ""
            if alone and "\ufffd" not in alone and not _BYTE_TOKEN.fullmatch(piece):
                text = alone
        self._texts[token] = text
        return text


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters split across tokens (byte-fallback
    vocabularies), so it decodes a short window and emits only text that is final: a trailing
    U+FFFD means the character is not complete yet.

    With `texts` (TokenTexts), a token whose own text is known, arriving when nothing is held back, is
    emitted as that text without decoding: the same delta and the same window as decoding would give, at
    a dictionary look-up instead of two decode calls per token.
    """

    def __init__(self, tokenizer, prompt_tail: list[int] | None = None, texts: TokenTexts | None = None):
        self._tok = tokenizer
        self._texts = texts
        self._ids: list[int] = list(prompt_tail or [])[-4:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: list[int]) -> str:
        if self._texts is not None and self._read_offset == len(self._ids):
            known = [self._texts.get(t) for t in token_ids]
            if known and None not in known:
                self._ids.extend(token_ids)
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                return "".join(known)
        self._ids.extend(token_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full_text = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


class StopMatcher:
    """Holds back text that may be the start of a stop string, and cuts the output at a full match."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._firsts = frozenset(s[0] for s in self._stops)  # where a held-back tail can start
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Text safe to emit now; sets `stopped` when a stop string completes (that text is dropped)."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        pending = self._pending + text
        cut = -1
        for stop in self._stops:
            i = pending.find(stop)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        keep = self._partial_suffix(pending)
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _partial_suffix(self, p: str) -> int:
        """Length of the longest tail of `p` that is a proper prefix of some stop string (`p` holds none
        whole). Only tails starting with some stop's first character are tried: per token, most text has
        none in its last `hold` characters, and then this is a few set look-ups."""
        for i in range(max(0, len(p) - self._hold), len(p)):
            if p[i] in self._firsts:
                tail = p[i:]
                for stop in self._stops:
                    if stop.startswith(tail):
                        return len(p) - i
        return 0
