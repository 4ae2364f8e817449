"""The bounds a worker checks on every GenerateRequest itself, whatever the gateway already checked.

    limits = RequestLimits.for_model(context_length=8192, vocab_size=262144, max_stop_strings=16, max_stop_length=256)
    problem = limits.problem(req)          # None, or a sentence naming the field out of bounds (answer 400)

The gateway validates client input first; a worker still refuses a request that would make it do
unbounded work (an argpartition per token for a huge `logprobs`, a stop list scanned every token, a
prediction longer than any context), so a bug or a forged request cannot get past the worker's own door.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from workers.protocol import GenerateRequest

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_STOP_TOKEN_IDS = 64
MAX_GRAMMAR_BYTES = 256 * 1024  # the gateway refuses schemas above 64 KiB; room for the tool-call wrapper
MAX_ID_BYTES = 11  # one token id in JSON, with its comma
# OpenAI's ranges, checked by the gateway (gateway/openai_types.py) and again here: (field, low, high, low excluded)
SAMPLING_RANGES = (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True), ("min_p", 0.0, 1.0, False),
                   ("presence_penalty", -2.0, 2.0, False), ("frequency_penalty", -2.0, 2.0, False))


@dataclass(frozen=True)
class RequestLimits:
    context_length: int
    vocab_size: int = 1 << 31
    max_stop_strings: int = 16
    max_stop_length: int = 256

    @property
    def max_body_bytes(self) -> int:
        """The largest request body that can hold a within-bounds request: prompt, prediction and resume
        ids, the grammar, stop strings, plus 64 KiB for the rest."""
        ids = 3 * self.context_length * MAX_ID_BYTES
        stops = self.max_stop_strings * self.max_stop_length * 6  # a JSON-escaped character is at most 6 bytes
        return ids + 6 * MAX_GRAMMAR_BYTES + stops + 64 * 1024

    def problem(self, req: GenerateRequest) -> str | None:
        for check in (self._sizes, self._stops, self._ids, self._sampling):
            reason = check(req)
            if reason:
                return reason
        return None

    def _sizes(self, req: GenerateRequest) -> str | None:
        ctx = self.context_length
        if not 0 < len(req.prompt_ids) < ctx:
            return f"prompt_ids has {len(req.prompt_ids)} tokens; 1 to {ctx - 1} are accepted"
        if not 0 < req.max_tokens <= ctx - len(req.prompt_ids):
            return f"max_tokens {req.max_tokens} does not fit the {ctx}-token context after the prompt"
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be in [0, {MAX_LOGPROBS}]; got {req.logprobs}"
        if req.prediction_ids is not None and len(req.prediction_ids) > ctx:
            return f"prediction_ids has {len(req.prediction_ids)} tokens; at most {ctx} are accepted"
        if req.grammar is not None and len(req.grammar.encode()) > MAX_GRAMMAR_BYTES:
            return f"grammar is over {MAX_GRAMMAR_BYTES} bytes"
        if req.max_draft_tokens is not None and req.max_draft_tokens < 0:
            return "max_draft_tokens must be >= 0"
        if len(req.resume_ids) >= req.max_tokens:
            return f"resume_ids has {len(req.resume_ids)} tokens; fewer than max_tokens ({req.max_tokens}) are accepted"
        return None

    def _stops(self, req: GenerateRequest) -> str | None:
        if len(req.stop) > self.max_stop_strings:
            return f"stop has {len(req.stop)} strings; at most {self.max_stop_strings} are accepted"
        if any(not s or len(s) > self.max_stop_length for s in req.stop):
            return f"every stop string must have 1 to {self.max_stop_length} characters"
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            return f"stop_token_ids has {len(req.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are accepted"
        return None

    def _ids(self, req: GenerateRequest) -> str | None:
        vocab = self.vocab_size
        for name, ids in (("prompt_ids", req.prompt_ids), ("prediction_ids", req.prediction_ids or ()),
                          ("stop_token_ids", req.stop_token_ids), ("resume_ids", req.resume_ids)):
            if ids and not (0 <= min(ids) and max(ids) < vocab):
                return f"{name} holds a token id outside [0, {vocab})"
        return None

    @staticmethod
    def _sampling(req: GenerateRequest) -> str | None:
        s = req.sampling
        for name, lo, hi, lo_open in SAMPLING_RANGES:
            v = getattr(s, name)
            if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
                return f"sampling.{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]; got {v}"
        if s.top_k < 0:
            return f"sampling.top_k must be >= 0; got {s.top_k}"
        return None
