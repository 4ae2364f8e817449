"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as an adapter onto
the chat core: `system`, `messages` with text / tool_use / tool_result blocks, `tools` with
`input_schema` and `tool_choice` become a ChatRequest, so templating, tokenization, tool-call parsing,
constrained decoding, admission and routing are the chat path's. Keys come as `x-api-key` (or a bearer
token) and are Pulse's keys; `anthropic-version` is accepted and not needed. Errors on these paths have
Anthropic's shape (`anthropic_error_response`).
"""
from __future__ import annotations

import json
import time
from typing import Any

import msgspec
from aiohttp import web

from gateway.adapters import Splitter, chat_off_loop, decode_strict, joined_text, renamed
from gateway.anthropic_events import MessagesEvents
from gateway.completions import Call, CompletionService, credentials
from gateway.errors import APIError, bad_param
from gateway.openai_types import ChatRequest, Message, ToolCall, ToolCallFunction
from gateway import structured
from gateway.structured import schema_text
from gateway import tools as agent_tools

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "api_error"}
_PARAMS = [("max_completion_tokens", "max_tokens", True), ("stop", "stop_sequences", True),
           ("messages", "messages", False), ("tool_choice", "tool_choice", False)]


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # accepted: every prompt's prefix is cached anyway


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None  # sampling knobs older clients send (newer SDKs no longer do)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    max_draft_tokens: int | None = None  # Pulse's extra, as on chat


class MessagesAPI:
    def __init__(self, service: CompletionService):
        self.service = service

    def add_routes(self, router: web.UrlDispatcher, read_body) -> None:
        async def create(request: web.Request) -> web.StreamResponse:
            return await self.service.serve(request, "messages", self.prepare, await read_body(request))

        async def count(request: web.Request) -> web.Response:
            return await self.count_tokens(request, await read_body(request))

        router.add_post("/v1/messages", create)
        router.add_post("/v1/messages/count_tokens", count)

    async def prepare(self, body: bytes, key) -> Call:
        req = decode_strict(body, MessagesRequest)
        if req.max_tokens < 1:
            raise bad_param("max_tokens", f"`max_tokens` must be >= 1; got {req.max_tokens}")
        if req.service_tier not in (None, "auto", "standard_only"):
            raise bad_param("service_tier", f"service tier {req.service_tier!r} is not offered")
        chat = chat_request(req, max_completion_tokens=req.max_tokens, stream=req.stream, stop=req.stop_sequences,
                            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            max_draft_tokens=req.max_draft_tokens)
        chat, gen, plan = await self._run(chat, len(body))
        mid = "msg_" + gen.request_id
        return Call(req.model, gen, req.stream, MessagesEvents(mid, chat.model, len(gen.prompt_ids), Splitter(plan)))

    async def count_tokens(self, request: web.Request, body: bytes) -> web.Response:
        """The prompt's tokens as this server would template and tokenize it (no worker involved)."""
        start = time.perf_counter()
        status = 500
        try:
            await self.service.auth.authenticate(credentials(request.headers))
            with structured.deferred() as schemas:  # compiled off the event loop, as on the chat path
                chat, gen, _ = await self._run(chat_request(decode_strict(body, CountTokensRequest)), len(body))
            await self.service.schemas.check(schemas)
            status = 200
            return web.json_response({"input_tokens": len(gen.prompt_ids)})
        except APIError as e:
            status = e.status
            raise
        finally:
            self.service.metrics.record_request(self.service.cfg.model.name, status, time.perf_counter() - start,
                                                api="count_tokens")

    async def _run(self, chat: ChatRequest, size: int):
        try:
            chat, gen = await chat_off_loop(self.service, chat, size)
            return chat, gen, agent_tools.plan_chat(chat)
        except APIError as e:
            raise renamed(e, _PARAMS + _tool_params(chat)) from None


def _tool_params(chat: ChatRequest) -> list[tuple[str, str, bool]]:
    """Chat's `tools[i].function.parameters` is this API's `tools.i.input_schema`."""
    n = range(len(chat.tools or []))
    return [(f"tools[{i}].function.parameters", f"tools.{i}.input_schema", False) for i in n] \
        + [(f"tools[{i}].function", f"tools.{i}", True) for i in n] + [(f"tools[{i}]", f"tools.{i}", True) for i in n]


# ---- the request, in chat terms -----------------------------------------------------------------
def chat_request(req: CountTokensRequest, **sampling) -> ChatRequest:
    if req.thinking and req.thinking.get("type") != "disabled":
        raise bad_param("thinking", "extended thinking is not supported by this model", code="unsupported_parameter")
    system = [Message(role="system", content=_text(req.system, "system"))] if req.system else []
    tools = chat_tools(req.tools)
    choice, parallel = chat_tool_choice(req.tool_choice)
    return ChatRequest(model=req.model, messages=system + chat_messages(req.messages), tools=tools,
                       tool_choice=choice if tools else None, parallel_tool_calls=parallel,
                       response_format=output_format(req.output_config), **sampling)


def output_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema) -> chat's `response_format`: the same constrained decoding."""
    config = config or {}
    if config.get("effort") is not None:
        raise bad_param("output_config.effort", "`output_config.effort` is not supported by this model",
                        code="unsupported_parameter")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise bad_param("output_config.format", "`output_config.format` is {'type': 'json_schema', 'schema': {...}}")
    schema_text(fmt["schema"], "output_config.format.schema")  # checked first: a 400 names this API's field
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_messages(messages: list[dict[str, Any]]) -> list[Message]:
    if not messages:
        raise bad_param("messages", "`messages` must contain at least one message")
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool result
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_param(f"messages.{i}.role", f"unknown role {role!r}; expected 'user' or 'assistant'")
        if isinstance(content, str):
            out.append(Message(role=role, content=content))
        elif isinstance(content, list):
            out += _blocks(role, content, f"messages.{i}.content", names)
        else:
            raise bad_param(f"messages.{i}.content", "`content` must be a string or a list of content blocks")
    return out


def _blocks(role: str, blocks: list, where: str, names: dict[str, str]) -> list[Message]:
    """One Anthropic turn -> chat messages: tool results first (as tool messages), then the text, with an
    assistant's tool_use blocks as its tool calls."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            tid, name = block.get("id"), block.get("name")
            if not isinstance(tid, str) or not isinstance(name, str) or not isinstance(block.get("input"), dict):
                raise bad_param(at, "a tool_use block has a string `id`, a string `name` and an object `input`")
            names[tid] = name
            calls.append(ToolCall(ToolCallFunction(name, json.dumps(block["input"], ensure_ascii=False)), id=tid))
        elif kind == "tool_result" and role == "user":
            tid = block.get("tool_use_id")
            if not isinstance(tid, str):
                raise bad_param(f"{at}.tool_use_id", "a tool_result block needs its `tool_use_id`")
            text = _text(block.get("content", ""), f"{at}.content")
            results.append(Message(role="tool", content=("Error: " + text) if block.get("is_error") else text,
                                   tool_call_id=tid, name=names.get(tid)))
        else:
            raise bad_param(f"{at}.type", f"content block type {kind!r} is not supported in a {role} turn; "
                            "use text, tool_use (assistant) or tool_result (user)", code="unsupported_value")
    text = "".join(texts)
    if role == "assistant":
        return [Message(role="assistant", content=text or ("" if not calls else None), tool_calls=calls or None)]
    return results + ([Message(role="user", content=text)] if texts or not results else [])


def _text(content: Any, where: str) -> str:
    return joined_text(content, where, kinds=("text",), part="{where}.{j}.type", noun="block")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools (`name`, `description`, `input_schema`) -> chat function tools; server tools are a 400."""
    if not tools:
        return None
    if len(tools) > agent_tools.MAX_TOOLS:  # before any schema is looked at
        raise bad_param("tools", f"at most {agent_tools.MAX_TOOLS} tools; got {len(tools)}")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_param(f"tools.{i}.type", f"tool type {kind!r} (a server or Anthropic-defined tool) is not "
                            "supported; only client tools with `input_schema` are", code="unsupported_value")
        fn = {"name": tool.get("name"), "description": tool.get("description") or ""}
        if "input_schema" in tool:  # checked first: a 400 names this API's field
            fn["parameters"] = tool["input_schema"]
            schema_text(tool["input_schema"], f"tools.{i}.input_schema")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict | None, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_param("tool_choice", "`tool_choice` is {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', "
                    "'name': ...}", code="invalid_value")


# ---- errors --------------------------------------------------------------------------------------
def anthropic_error_response(err: APIError) -> web.Response:
    """`{"type": "error", "error": {"type", "message"}}` with the same HTTP status and headers."""
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "invalid_request_error"),
                                       "message": message}}
    return web.Response(status=err.status, body=msgspec.json.encode(body), content_type="application/json",
                        headers=err.headers)
