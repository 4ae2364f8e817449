"""OpenAI response bodies: chat and text completions, streamed chunks, usage, logprobs."""
from __future__ import annotations

from workers.protocol import TokenLogprob, Usage


def usage_body(u: Usage) -> dict:
    """OpenAI's usage object; prediction tokens keep OpenAI's meaning (the given prediction's tokens found /
    not found in the completion), and Pulse's own speculation counters go in `pulse_speculation`."""
    body = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
        },
    }
    if u.drafted_tokens:
        body["pulse_speculation"] = {"drafted_tokens": u.drafted_tokens, "accepted_tokens": u.accepted_tokens}
    return body


class Shaper:
    """Builds the JSON objects of one response (chat or text completion, stream or not)."""

    def __init__(self, kind: str, rid: str, created: int, model: str, token_text):
        self.kind, self.rid, self.created, self.model = kind, rid, created, model
        self._token_text = token_text  # token id -> its text, for logprobs
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def chat_logprobs(self, items: list[TokenLogprob]) -> dict:
        def entry(tid: int, lp: float) -> dict:
            text = self._token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [dict(entry(t.token_id, t.logprob), top_logprobs=[entry(i, lp) for i, lp in t.top])
                            for t in items]}

    def text_logprobs(self, items: list[TokenLogprob]) -> dict:
        return {
            "tokens": [self._token_text(t.token_id) for t in items],
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{self._token_text(i): lp for i, lp in t.top} for t in items],
            "text_offset": [],
        }

    def stream_chunk(self, text: str, finish: str | None, logprobs: list[TokenLogprob] | None, first: bool) -> dict:
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if logprobs:
                choice["logprobs"] = self.chat_logprobs(logprobs)
            return dict(self._head("chat.completion.chunk"), choices=[choice])
        choice = {"index": 0, "text": text, "logprobs": self.text_logprobs(logprobs) if logprobs else None,
                  "finish_reason": finish}
        return dict(self._head("text_completion"), choices=[choice])

    def usage_chunk(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return dict(self._head(obj), choices=[], usage=usage_body(usage))

    def whole(self, text: str, finish: str, usage: Usage, logprobs: list[TokenLogprob] | None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": self.chat_logprobs(logprobs) if logprobs is not None else None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.text_logprobs(logprobs) if logprobs is not None else None,
                      "finish_reason": finish}
        return dict(self._head(self.object), choices=[choice], usage=usage_body(usage))
