"""Tool calls on /v1/chat/completions: `tools` + `tool_choice` into the prompt, the model's reply back
into OpenAI `tool_calls` (whole or as incremental stream deltas), `finish_reason: "tool_calls"`.

Gemma 3 has no tool tokens and the bundled GGUF has no template, so the functions go into the system
prompt as an instruction block with their JSON schemas, asking for a JSON reply
`{"name": ..., "arguments": {...}}`. A model whose embedded template takes `tools` gets them that way
instead (PromptBuilder.native_tools). `tool_choice: "required"` or a named function also constrains
decoding to the calls' schema (gateway/structured.py), so a forced call always parses and validates;
`auto` leaves the model free and parses what it wrote; `none` leaves the tools out.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import bad_param
from gateway.openai_types import ChatRequest, Message
from gateway.structured import response_format_grammar, schema_text, tool_call_schema
from gateway.tool_parser import ToolCallStream, ToolDelta

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128


@dataclass
class ChatPlan:
    """What tools and response_format mean for one chat request."""

    functions: list[dict[str, Any]] = field(default_factory=list)  # {"name", "description", "parameters"}
    mode: str = "none"  # "none": no tools in play; "auto": parse if the model calls; "forced": it must call
    grammar: str | None = None  # JSON schema text the worker enforces (GenerateRequest.grammar)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


def plan_chat(req: ChatRequest) -> ChatPlan:
    """Validate `tools`, `tool_choice` and `response_format` into a plan; 400s name the parameter."""
    functions = _functions(req.tools)
    choice = req.tool_choice
    if choice is not None and not functions:
        raise bad_param("tool_choice", "`tool_choice` is only allowed when `tools` are given")
    grammar = response_format_grammar(req.response_format)
    if not functions or choice == "none":
        return ChatPlan(grammar=grammar)
    if choice is None or choice == "auto":
        return ChatPlan(functions, "auto", grammar)
    if choice == "required":
        chosen = functions
    elif isinstance(choice, dict):
        chosen = [_named(choice, functions)]
    else:
        raise bad_param("tool_choice", f"unknown `tool_choice` {choice!r}; expected 'none', 'auto', 'required' "
                        "or {'type': 'function', 'function': {'name': ...}}")
    return ChatPlan(chosen, "forced", schema_text(tool_call_schema(chosen), "tools"))


def _functions(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise bad_param("tools", f"at most {MAX_TOOLS} tools; got {len(tools)}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise bad_param(f"tools[{i}].type", f"tool type {tool.get('type')!r} is not supported; use 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_param(f"tools[{i}].function", "`function` must be an object with `name` and `parameters`")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_param(f"tools[{i}].function.name", "function names must be 1-64 characters of a-z, A-Z, "
                            f"0-9, '_' or '-'; got {name!r}")
        if name in seen:
            raise bad_param(f"tools[{i}].function.name", f"function {name!r} is defined twice")
        seen.add(name)
        if "parameters" not in fn:
            raise bad_param(f"tools[{i}].function.parameters", f"function {name!r} has no `parameters` schema "
                            "(use {\"type\": \"object\", \"properties\": {}} for none)")
        params = fn["parameters"]
        schema_text(params, f"tools[{i}].function.parameters")  # a schema the grammar library can compile
        desc = fn.get("description")
        out.append({"name": name, "description": desc if isinstance(desc, str) else "", "parameters": params})
    return out


def _named(choice: dict[str, Any], functions: list[dict[str, Any]]) -> dict[str, Any]:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_param("tool_choice", "a named `tool_choice` is {'type': 'function', 'function': {'name': ...}}")
    for f in functions:
        if f["name"] == name:
            return f
    raise bad_param("tool_choice", f"`tool_choice` names function {name!r}, which is not in `tools` "
                    f"({', '.join(sorted(f['name'] for f in functions))})", code="unknown_function")


# ---- the prompt ------------------------------------------------------------------------------------
def instructions(plan: ChatPlan) -> str:
    """The system-prompt block that teaches a model without tool tokens to call the functions."""
    specs = "\n".join(json.dumps({"name": f["name"], "description": f["description"], "parameters": f["parameters"]},
                                 ensure_ascii=False) for f in plan.functions)
    if plan.mode == "forced" and len(plan.functions) == 1:
        ask = f"You must call the function `{plan.functions[0]['name']}` now."
    elif plan.mode == "forced":
        ask = "You must call one of these functions now."
    else:
        ask = "Call a function when it helps to answer; otherwise answer normally, without JSON."
    return ("You can call these functions. To call one, reply with only a JSON object "
            '{"name": <function name>, "arguments": <an object matching its parameters>}, or a JSON list of '
            f"such objects to call several at once, and nothing else. {ask}\n"
            "Function results come back in a later turn as \"Tool result\".\n\nFunctions:\n" + specs)


def build_prompt(builder, messages: list[Message], plan: ChatPlan):
    """The chat prompt with the plan's tools: as template data where the model's template takes them."""
    if plan.mode != "none" and getattr(builder, "native_tools", False):
        return builder.chat(messages, tools=[{"type": "function", "function": f} for f in plan.functions])
    return builder.chat(prompt_messages(messages, plan))


def prompt_messages(messages: list[Message], plan: ChatPlan) -> list[Message]:
    """`messages` with the tool instructions folded into (or placed as) the first system message."""
    if plan.mode == "none":
        return messages
    block = instructions(plan)
    if messages and messages[0].role in ("system", "developer"):
        first = messages[0]
        text = first.content if isinstance(first.content, str) else "".join(p.text or "" for p in first.content or [])
        return [Message(role=first.role, content=f"{text}\n\n{block}" if text else block), *messages[1:]]
    return [Message(role="system", content=block), *messages]


# ---- the response ----------------------------------------------------------------------------------
class ToolShaper:
    """Wraps gateway.responses.Shaper for a chat request with tools: tool calls out of the text."""

    def __init__(self, inner, plan: ChatPlan):
        self._inner, self._plan = inner, plan
        self._stream = ToolCallStream(plan.names, forced=plan.mode == "forced")

    @classmethod
    def wrap(cls, req: ChatRequest, inner):
        plan = plan_chat(req)
        return inner if plan.mode == "none" else cls(inner, plan)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def stream_chunk(self, text: str, finish: str | None, logprobs, first: bool) -> dict:
        delta = self._stream.feed(text) if text else ToolDelta()
        if finish is not None:
            delta.extend(self._stream.finish())
            finish = _finish(finish, self._stream.calls)
        body = self._inner.stream_chunk(delta.content, finish, logprobs, first)
        if delta.tool_calls:
            out = body["choices"][0]["delta"]
            out["tool_calls"] = delta.tool_calls
            if not out.get("content"):
                out.pop("content", None)
        return body

    def whole(self, text: str, finish: str, usage, logprobs) -> dict:
        delta = self._stream.feed(text)
        delta.extend(self._stream.finish())
        calls = self._stream.calls
        body = self._inner.whole(delta.content, _finish(finish, calls), usage, logprobs)
        if calls:
            message = body["choices"][0]["message"]
            message["content"] = delta.content.strip() or None
            message["tool_calls"] = [c.body() for c in calls]
        return body


def _finish(finish: str, calls: list) -> str:
    return "tool_calls" if calls and finish == "stop" else finish
