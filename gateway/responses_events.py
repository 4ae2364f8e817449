"""The Responses API's output: the response object, its output items, and the typed stream events.

A streamed response goes `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its deltas (`response.content_part.added` + `response.output_text.delta`
for a message, `response.function_call_arguments.delta` for a function call), its `.done` events and
`response.output_item.done`, and ends with `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it, `response.failed` on an error). Every event carries `sequence_number`.
A non-streamed response runs the same item builder and discards the events, so both agree.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.adapters import Splitter, sse
from gateway.completions import Events
from gateway.tool_parser import ToolDelta
from workers.protocol import Usage


def usage_body(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ResponsesEvents(Events):
    """Builds one response's output items from the model's text, as events or as a whole object.

    `head`: the response object's fields that do not change (id, model, echoed request fields);
    `settle(response, output)`: awaited once the response is final, before the client sees the end
    (stores it); it may change fields of `response` (e.g. `store` when the response could not be kept).
    """

    def __init__(self, head: dict[str, Any], splitter: Splitter,
                 settle: Callable[[dict, list[dict]], Awaitable[None]]):
        self.head, self.splitter, self.settle = head, splitter, settle
        self.items: list[dict] = []  # output items, in output_index order
        self._open: int | None = None  # output index of the item receiving deltas
        self._calls: dict[int, int] = {}  # tool-call index (parser) -> output index
        self._seq = 0

    # ---- Events ------------------------------------------------------------------------------
    def delta(self, text, logprobs, first) -> bytes:
        out = []
        if first:
            out += [self._lifecycle("response.created", "in_progress"),
                    self._lifecycle("response.in_progress", "in_progress")]
        out += self._apply(self.splitter.feed(text))
        return b"".join(out)

    async def end(self, finish, usage) -> bytes:
        out = self._apply(self.splitter.finish())
        out += self._close(finish)
        response = await self._final(finish, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=response))
        return b"".join(out)

    def error(self, message: str) -> bytes:
        opened = [] if self._seq else [self._lifecycle("response.created", "in_progress")]  # failed before any output
        response = self.response("failed", error={"code": "server_error", "message": message})
        return b"".join(opened + [self._event("response.failed", response=response)])

    async def whole(self, text, finish, usage, logprobs) -> dict:
        self._apply(self.splitter.feed(text))
        self._apply(self.splitter.finish())
        self._close(finish)
        return await self._final(finish, usage)

    # ---- the response object -----------------------------------------------------------------
    def response(self, status: str, *, usage: Usage | None = None, error: dict | None = None,
                 incomplete: str | None = None) -> dict:
        done = status in ("completed", "incomplete")
        return dict(self.head, status=status, output=list(self.items), error=error,
                    incomplete_details={"reason": incomplete} if incomplete else None,
                    usage=usage_body(usage) if usage is not None else None,
                    completed_at=int(time.time()) if done else None)

    async def _final(self, finish: str, usage: Usage) -> dict:
        incomplete = "max_output_tokens" if finish == "length" else None
        response = self.response("incomplete" if incomplete else "completed", usage=usage, incomplete=incomplete)
        await self.settle(response, self.items)
        return response

    # ---- items -------------------------------------------------------------------------------
    def _apply(self, delta: ToolDelta) -> list[bytes]:
        out = []
        if delta.content:
            out += self._text(delta.content)
        for piece in delta.tool_calls:
            if "id" in piece:
                out += self._open_call(piece)
            args = piece["function"].get("arguments", "")
            if args:
                index = self._calls[piece["index"]]
                self.items[index]["arguments"] += args
                out.append(self._event("response.function_call_arguments.delta", item_id=self.items[index]["id"],
                                       output_index=index, delta=args))
        return out

    def _text(self, text: str) -> list[bytes]:
        out = []
        if self._open is None or self.items[self._open]["type"] != "message":
            out += self._close("stop")
            item = {"id": "msg_" + secrets.token_hex(12), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            out += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._open,
                                   content_index=0, part=part))
        self.items[self._open]["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self.items[self._open]["id"],
                               output_index=self._open, content_index=0, delta=text, logprobs=[]))
        return out

    def _open_call(self, piece: dict) -> list[bytes]:
        out = self._close("stop")
        call_id = piece["id"]
        item = {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "status": "in_progress",
                "call_id": call_id, "name": piece["function"]["name"], "arguments": ""}
        out += self._add(item)
        self._calls[piece["index"]] = self._open
        return out

    def _add(self, item: dict) -> list[bytes]:
        self.items.append(item)
        self._open = len(self.items) - 1
        return [self._event("response.output_item.added", output_index=self._open, item=item)]

    def _close(self, finish: str) -> list[bytes]:
        """Finish the open item: its `.done` events, then `response.output_item.done`."""
        if self._open is None:
            return []
        index, item = self._open, self.items[self._open]
        self._open = None
        item["status"] = "incomplete" if finish == "length" else "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    # ---- framing -----------------------------------------------------------------------------
    def _lifecycle(self, kind: str, status: str) -> bytes:
        return self._event(kind, response=self.response(status))

    def _event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(kind, body)

