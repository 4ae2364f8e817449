"""The model's tool-call text -> OpenAI `tool_calls`, incrementally, so a stream and a whole response agree.

The format (what gateway/tools.py asks the model for, and what a forced call's schema enforces):
`{"name": "<function>", "arguments": {...}}`, or several such objects in a JSON list or one after
another; a Markdown code fence around them is tolerated. Arguments are passed on as the model wrote them
(the raw JSON text of the value), so the streamed argument deltas concatenate to exactly the
non-streamed `arguments` string.

In `auto` mode, text that does not start like a call to a known function is content; it is held back
only while it still might turn out to be a call (it starts with `{`, `[` or a fence).
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_FENCE = re.compile(r"```[a-zA-Z_]*[ \t]*\n")
HEADER_WINDOW = 256  # give up on a would-be call whose header has not appeared within this many chars


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI delta entries, one per call index

    def add_call_piece(self, index: int, piece: dict) -> None:
        for entry in self.tool_calls:
            if entry["index"] == index:
                entry["function"]["arguments"] += piece["function"].get("arguments", "")
                return
        self.tool_calls.append(piece)

    def extend(self, other: ToolDelta) -> None:
        self.content += other.content
        for entry in other.tool_calls:
            self.add_call_piece(entry["index"], entry)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream:
    """Feed model text in pieces; get content and tool-call deltas out. `calls` holds the result."""

    def __init__(self, known_names: set[str], forced: bool = False):
        self.known, self.forced = known_names, forced
        self.calls: list[ParsedCall] = []
        self._buf, self._pos, self._state = "", 0, "start"
        self._depth, self._in_str, self._esc = 0, False, False

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        out = ToolDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ToolDelta:
        self._final_flush = True
        out = self.feed("")
        if not self.calls and self._state != "content":  # never became a call: it was content all along
            out.content += self._buf
            self._state = "content"
            self._buf, self._pos = "", 0
        return out

    # ---- the state machine: each step consumes what it can and says whether to go on ----------
    def _step(self, out: ToolDelta) -> bool:
        return getattr(self, "_" + self._state)(out)

    def _start(self, out: ToolDelta) -> bool:
        rest = self._buf[self._pos:].lstrip()
        if not rest:
            return False
        if rest[0] in "{[" or self.forced:
            self._pos = len(self._buf) - len(rest) + (1 if rest[0] == "[" else 0)
            self._state = "expect"
            return True
        if rest.startswith("```"):
            m = _FENCE.match(rest)
            if m is None:  # wait for the fence's line to end, unless this is not a fence line at all
                return False if "\n" not in rest and len(rest) < 32 else self._give_up(out)
            self._pos = len(self._buf) - len(rest) + m.end()
            self._state = "expect"
            return True
        if "```".startswith(rest):
            return False  # one or two backticks so far: maybe a fence
        return self._give_up(out)

    def _expect(self, out: ToolDelta) -> bool:
        rest = self._buf[self._pos:]
        stripped = rest.lstrip(" \t\r\n,")
        self._pos += len(rest) - len(stripped)
        if not stripped:
            return False
        if stripped[0] != "{":
            self._state = "tail"
            return True
        m = _HEADER.match(stripped)
        if m is None:
            if len(stripped) < HEADER_WINDOW and not self._final_flush:
                return False
            return self._give_up(out) if not self.calls else self._to_tail()
        name = m.group(1)
        if name not in self.known and not self.forced:
            return self._give_up(out) if not self.calls else self._to_tail()
        call = ParsedCall(id="call_" + secrets.token_hex(12), name=name)
        self.calls.append(call)
        out.add_call_piece(len(self.calls) - 1, {"index": len(self.calls) - 1, **call.body()})
        self._pos += m.end()
        self._state, self._depth, self._in_str, self._esc = "args", 0, False, False
        return True

    def _args(self, out: ToolDelta) -> bool:
        start, i, buf = self._pos, self._pos, self._buf
        while i < len(buf):
            ch = buf[i]
            i += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._emit_args(out, buf[start:i])
                    self._pos, self._state = i, "close"
                    return True
        self._emit_args(out, buf[start:i])
        self._pos = i
        return False

    def _emit_args(self, out: ToolDelta, piece: str) -> None:
        if piece:
            index = len(self.calls) - 1
            self.calls[index].arguments += piece
            out.add_call_piece(index, {"index": index, "function": {"arguments": piece}})

    def _close(self, out: ToolDelta) -> bool:
        rest = self._buf[self._pos:]
        stripped = rest.lstrip()
        if not stripped:
            return False
        self._pos += len(rest) - len(stripped)
        if stripped[0] == "}":
            self._pos += 1
            self._state = "expect"
        else:
            self._state = "tail"
        return True

    def _tail(self, out: ToolDelta) -> bool:
        self._pos = len(self._buf)  # text after the calls (a closing fence, chatter) is not part of them
        return False

    def _content(self, out: ToolDelta) -> bool:
        out.content += self._buf[self._pos:]
        self._buf, self._pos = "", 0
        return False

    # ---- helpers ----------------------------------------------------------------------------
    _final_flush = False  # set by finish(): no more text is coming, stop waiting for a header

    def _to_tail(self) -> bool:
        self._state = "tail"
        return True

    def _give_up(self, out: ToolDelta) -> bool:
        """Not a call after all: everything so far (nothing of it was sent yet) is content."""
        self._state, self._pos = "content", 0
        return True


def parse_tool_calls(text: str, known_names: set[str], forced: bool = False) -> tuple[str, list[ParsedCall]]:
    """Whole text -> (content, calls): the same parse a stream gets."""
    stream = ToolCallStream(known_names, forced)
    delta = stream.feed(text)
    delta.extend(stream.finish())
    return delta.content, stream.calls
