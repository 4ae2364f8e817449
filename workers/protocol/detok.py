"""Token ids to streamed text: incremental detokenization and stop strings.

Shared by every backend that produces token ids itself (the engine); llama-server does its own.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters split across tokens (byte-fallback
    vocabularies), so it decodes a short window and emits only text that is final: a trailing
    U+FFFD means the character is not complete yet.
    """

    def __init__(self, tokenizer, prompt_tail: list[int] | None = None):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_tail or [])[-4:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: list[int]) -> str:
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
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Text safe to emit now; sets `stopped` when a stop string completes (that text is dropped)."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._partial_suffix()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest tail of pending text that is a proper prefix of some stop string."""
        p = self._pending
        for n in range(min(self._hold, len(p)), 0, -1):
            tail = p[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
