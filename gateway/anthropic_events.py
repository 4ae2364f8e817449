"""The Messages API's output: the message object and Anthropic's stream events.

A stream goes `message_start` (the message with empty content), `ping`, then per content block
`content_block_start`, its `content_block_delta`s (`text_delta`, or `input_json_delta` for a tool_use
block's input) and `content_block_stop`, then `message_delta` (stop_reason, final usage) and
`message_stop`. A non-streamed message runs the same block builder, so both agree.

Usage follows Anthropic's split: `input_tokens` are the prompt tokens not read from a cache,
`cache_read_input_tokens` those that were.
"""
from __future__ import annotations

import json
import logging

from gateway.adapters import Splitter, sse
from gateway.completions import Events
from gateway.tool_parser import ToolDelta
from workers.protocol import Usage

log = logging.getLogger("pulse.gateway.messages")


def usage_body(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish: str, blocks: list[dict]) -> str:
    if finish == "length":
        return "max_tokens"
    return "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"


class MessagesEvents(Events):
    def __init__(self, mid: str, model: str, prompt_tokens: int, splitter: Splitter):
        self.mid, self.model, self.prompt_tokens, self.splitter = mid, model, prompt_tokens, splitter
        self.blocks: list[dict] = []  # content blocks; a tool_use block keeps its input as JSON text here
        self._open = False  # whether the last block still receives deltas

    def message(self, finish: str | None, usage: Usage) -> dict:
        content = [_final(b) for b in self.blocks] if finish is not None else []
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason(finish, self.blocks) if finish is not None else None,
                "stop_sequence": None, "usage": usage_body(usage)}

    # ---- Events ------------------------------------------------------------------------------
    def delta(self, text, logprobs, first) -> bytes:
        out = []
        if first:
            out.append(sse("message_start", {"type": "message_start",
                                             "message": self.message(None, Usage(prompt_tokens=self.prompt_tokens))}))
            out.append(sse("ping", {"type": "ping"}))
        out += self._apply(self.splitter.feed(text))
        return b"".join(out)

    async def end(self, finish, usage) -> bytes:
        out = self._apply(self.splitter.finish()) + self._close()
        delta = {"stop_reason": stop_reason(finish, self.blocks), "stop_sequence": None}
        out.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_body(usage)}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, message: str) -> bytes:
        return sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})

    async def whole(self, text, finish, usage, logprobs) -> dict:
        self._apply(self.splitter.feed(text))
        self._apply(self.splitter.finish())
        self._close()
        return self.message(finish, usage)

    # ---- blocks ------------------------------------------------------------------------------
    def _apply(self, delta: ToolDelta) -> list[bytes]:
        out = []
        if delta.content:
            if not (self._open and self.blocks[-1]["type"] == "text"):
                out += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += delta.content
            out.append(self._delta({"type": "text_delta", "text": delta.content}))
        for piece in delta.tool_calls:
            if "id" in piece:
                tid = "toolu_" + piece["id"].removeprefix("call_")
                out += self._start({"type": "tool_use", "id": tid, "name": piece["function"]["name"], "input": ""})
            args = piece["function"].get("arguments", "")
            if args:
                self.blocks[-1]["input"] += args
                out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out

    def _start(self, block: dict) -> list[bytes]:
        out = self._close()
        self.blocks.append(block)
        self._open = True
        shown = dict(block, input={}) if block["type"] == "tool_use" else block
        out.append(sse("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                               "content_block": shown}))
        return out

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                           "delta": delta})

    def _close(self) -> list[bytes]:
        if not self._open:
            return []
        self._open = False
        return [sse("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]


def _final(block: dict) -> dict:
    """A block as the message carries it: a tool_use block's input as an object."""
    if block["type"] != "tool_use":
        return block
    try:
        value = json.loads(block["input"] or "{}")
    except ValueError:  # cut short by max_tokens: the input written so far is not whole JSON
        log.info("tool_use %s input is not complete JSON; sending {}", block["id"])
        value = {}
    return dict(block, input=value if isinstance(value, dict) else {})
