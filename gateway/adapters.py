"""What the Responses and Messages adapters share: strict body decoding, SSE framing with event names,
output split into text and tool calls, and error params renamed to the caller's field names.

Both adapters turn their request into a ChatRequest and run the chat core (gateway/completions.py), so a
chat-side 400 names a chat field (`messages[3]`, `max_completion_tokens`); `renamed` maps it back.
"""
from __future__ import annotations

import asyncio
import re
from typing import Any

import msgspec

from gateway.completions import OFF_LOOP_BYTES
from gateway.errors import APIError, bad_param
from gateway.openai_types import decode
from gateway.tool_parser import ToolCallStream, ToolDelta
from gateway.tools import ChatPlan

_json = msgspec.json.Encoder()
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def joined_text(content: Any, where: str, *, kinds: tuple[str, ...], part: str, noun: str) -> str:
    """Message text as both APIs send it: a string, or a list of text parts of the types `kinds` (joined);
    anything else is a 400 naming the part (`part` formats its path from `where` and the index `j`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, f"`{where}` must be a string or a list of text {noun}s")
    texts = []
    for j, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in kinds or not isinstance(item.get("text"), str):
            raise bad_param(part.format(where=where, j=j), f"{noun} type {kind!r} is not supported; use {kinds[0]!r}",
                            code="unsupported_value")
        texts.append(item["text"])
    return "".join(texts)


def decode_strict(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Parse a body into `kind` (a Struct with forbid_unknown_fields) as openai_types.decode does; a field
    this server does not implement is a 400 naming it, not silently ignored."""
    try:
        return decode(body, kind)
    except APIError as e:
        unknown = _UNKNOWN.search(e.message) if e.code == "invalid_type" else None
        if unknown is None:
            raise
        name = f"{e.param}.{unknown.group(1)}" if e.param else unknown.group(1)
        raise bad_param(name, f"`{name}` is not supported by this server", code="unsupported_parameter") from None


def sse(event: str, data: dict) -> bytes:
    """One named server-sent event (both APIs name every event and repeat the name as `type`)."""
    return b"event: " + event.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


def require_str(value: Any, param: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise bad_param(param, f"`{param}` must be a string")
    return value


class Splitter:
    """The model's text -> content and tool-call pieces, with the chat path's parser (gateway/tool_parser.py).
    Without tools in play all text is content."""

    def __init__(self, plan: ChatPlan):
        self.calls_parser = ToolCallStream(plan.names, forced=plan.mode == "forced") if plan.mode != "none" else None

    def feed(self, text: str) -> ToolDelta:
        if self.calls_parser is None:
            return ToolDelta(content=text)
        return self.calls_parser.feed(text) if text else ToolDelta()

    def finish(self) -> ToolDelta:
        return self.calls_parser.finish() if self.calls_parser is not None else ToolDelta()


async def chat_off_loop(service, chat, size: int):
    """`service.chat_request(chat)`, on a thread when the prompt's text is long (`size` bytes): as the chat
    path does with a long body, so templating and tokenizing never hold the event loop for long."""
    if size < OFF_LOOP_BYTES:
        return service.chat_request(chat)
    return await asyncio.to_thread(service.chat_request, chat)


def renamed(error: APIError, names: list[tuple[str, str, bool]]) -> APIError:
    """`error` with its param's chat-side prefix replaced by this API's field name (first match wins):
    `(chat, own, keep_rest)`; keep_rest False drops what follows (message indices differ between APIs)."""
    if error.param:
        for chat, own, keep_rest in names:
            p = error.param
            if p == chat or p.startswith(chat + ".") or p.startswith(chat + "["):
                error.param = own + (p[len(chat):] if keep_rest else "")
                break
    return error
