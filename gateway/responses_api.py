"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) as an adapter onto
the chat core: the request becomes a ChatRequest (instructions, the stored conversation, the input
items, function tools, `text.format`) and runs through CompletionService like any chat request.

Stored responses (`store`, default true) keep the conversation behind them as chat messages, so
`previous_response_id` is one store read and the continuation's prompt starts with the earlier turns'
exact text: the prefix router sends it to the worker whose KV cache holds them, on any gateway replica.
The conversation's first response id is also the request's session id (affinity when the index is cold).
A stored response belongs to the key that made it: another key reads 404.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from gateway.adapters import Splitter, chat_off_loop, decode_strict, joined_text, renamed
from gateway.completions import Call, CompletionService, credentials
from gateway.errors import APIError, bad_param
from gateway.openai_types import ChatRequest, Message, ToolCall, ToolCallFunction
from gateway.response_store import ResponseStore, StoreUnavailable
from gateway.responses_events import ResponsesEvents
from gateway.structured import schema_text
from gateway import tools as agent_tools

log = logging.getLogger("pulse.gateway.responses")
MAX_METADATA = 16  # OpenAI's own bounds on `metadata`: pairs, key and value length
BUILT_IN = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
            "image_generation", "mcp", "local_shell", "shell", "custom", "apply_patch")
_PARAMS = [("max_completion_tokens", "max_output_tokens", True), ("messages", "input", False),
           ("response_format.json_schema.schema", "text.format.schema", True),
           ("response_format", "text.format", False)]


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    max_draft_tokens: int | None = None  # Pulse's extra, as on chat


class Stored(msgspec.Struct):
    """One stored response: the object GET returns and the conversation a continuation starts from."""

    response: dict[str, Any]
    messages: list[Message]
    conversation: str  # the first response id of the conversation
    key_id: str | None = None


class ResponsesAPI:
    def __init__(self, service: CompletionService, store: ResponseStore):
        self.service, self.store = service, store

    def add_routes(self, router: web.UrlDispatcher, read_body) -> None:
        async def create(request: web.Request) -> web.StreamResponse:
            return await self.service.serve(request, "responses", self.prepare, await read_body(request))

        router.add_post("/v1/responses", create)
        router.add_get("/v1/responses/{id}", self.retrieve)
        router.add_delete("/v1/responses/{id}", self.delete)

    # ---- create ------------------------------------------------------------------------------
    async def prepare(self, body: bytes, key) -> Call:
        req = decode_strict(body, ResponsesRequest)
        _check_unsupported(req)
        prev, size = await self._load(req.previous_response_id, key, "previous_response_id") \
            if req.previous_response_id else (None, 0)
        history = prev.messages if prev else []
        new = input_messages(req.input)
        system = [Message(role="system", content=req.instructions)] if req.instructions else []
        chat = ChatRequest(model=req.model, messages=system + history + new, stream=req.stream,
                           max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                           tools=chat_tools(req.tools), tool_choice=_choice(req),
                           parallel_tool_calls=req.parallel_tool_calls, response_format=chat_format(req.text),
                           max_draft_tokens=req.max_draft_tokens)
        try:
            chat, gen = await chat_off_loop(self.service, chat, len(body) + size)
            plan = agent_tools.plan_chat(chat)
        except APIError as e:
            raise renamed(e, _PARAMS) from None
        rid = "resp_" + gen.request_id
        conversation = prev.conversation if prev else rid
        gen.session_id = "resp:" + conversation
        head = self._head(req, rid, chat.model)
        turn = history + new  # what the next turn continues from (instructions are per request)
        key_id = key.key_id if key is not None else None

        async def settle(response: dict, output: list[dict]) -> None:
            if req.store:
                entry = Stored(response, turn + output_messages(output), conversation, key_id)
                response["store"] = await self._save(rid, entry)

        return Call(req.model, gen, req.stream, ResponsesEvents(head, Splitter(plan), settle))

    def _head(self, req: ResponsesRequest, rid: str, model: str) -> dict:
        return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id, "parallel_tool_calls":
                req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
                "reasoning": {"effort": None, "summary": None}, "store": req.store,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p,
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "truncation": "disabled", "user": req.user, "metadata": req.metadata or {}}

    # ---- the store ---------------------------------------------------------------------------
    async def _save(self, rid: str, entry: Stored) -> bool:
        try:
            if await self.store.put(rid, msgspec.json.encode(entry)):
                return True
            log.warning("response %s not stored: larger than %d bytes", rid, self.store.max_bytes)
        except (StoreUnavailable, RedisError) as e:  # e.g. Redis at its maxmemory: answer, unstored
            log.warning("response %s not stored: %s", rid, e)
        return False

    async def _load(self, rid: str, key, param: str | None = None) -> tuple[Stored, int]:
        """The stored response and its size in bytes; a 404 when it is gone or another key's."""
        if not isinstance(rid, str) or not 0 < len(rid) <= 128:
            raise bad_param(param or "id", "a response id is a string of 1-128 characters")
        try:
            data = await self.store.get(rid)
        except StoreUnavailable:
            raise APIError(503, "the response store is unreachable; retry shortly", code="store_unavailable",
                           headers={"Retry-After": "1"}) from None
        try:
            entry = msgspec.json.decode(data, type=Stored) if data is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):  # written by an incompatible version
            log.warning("stored response %s cannot be read; treating it as gone", rid)
            entry = None
        key_id = key.key_id if key is not None else None
        if entry is None or (entry.key_id is not None and entry.key_id != key_id):
            raise APIError(404, f"No response found with id '{rid}'.", param=param, code="response_not_found")
        return entry, len(data)

    async def retrieve(self, request: web.Request) -> web.Response:
        key = await self.service.auth.authenticate(credentials(request.headers))
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise bad_param("stream", "streaming a stored response is not supported", code="unsupported_parameter")
        entry, _ = await self._load(request.match_info["id"], key)
        return web.json_response(entry.response, dumps=lambda o: msgspec.json.encode(o).decode())

    async def delete(self, request: web.Request) -> web.Response:
        key = await self.service.auth.authenticate(credentials(request.headers))
        rid = request.match_info["id"]
        await self._load(rid, key)
        try:
            await self.store.delete(rid)
        except StoreUnavailable:
            raise APIError(503, "the response store is unreachable; retry shortly", code="store_unavailable",
                           headers={"Retry-After": "1"}) from None
        return web.json_response({"id": rid, "object": "response", "deleted": True})


# ---- the request, in chat terms -----------------------------------------------------------------
def _check_unsupported(req: ResponsesRequest) -> None:
    """Fields Pulse knows but does not implement: a 400 naming them rather than a silent difference."""
    if req.background:
        raise bad_param("background", "background responses are not supported", code="unsupported_parameter")
    if req.include:
        raise bad_param("include", f"`include` values are not supported: {req.include}", code="unsupported_parameter")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise bad_param("reasoning", "`reasoning` is not supported by this model", code="unsupported_parameter")
    if req.truncation not in (None, "disabled"):
        raise bad_param("truncation", "only `truncation: disabled` is supported", code="unsupported_value")
    if req.service_tier not in (None, "auto", "default"):
        raise bad_param("service_tier", f"service tier {req.service_tier!r} is not offered", code="unsupported_value")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_param("max_output_tokens", f"`max_output_tokens` must be >= 1; got {req.max_output_tokens}")
    if req.metadata and (len(req.metadata) > MAX_METADATA or any(len(k) > 64 or len(v) > 512
                                                                   for k, v in req.metadata.items())):
        raise bad_param("metadata", "`metadata` holds at most 16 pairs, keys of 64 and values of 512 characters")


def input_messages(value: str | list[dict[str, Any]]) -> list[Message]:
    """`input` (a string, or message / function_call / function_call_output items) -> chat messages."""
    if isinstance(value, str):
        return [Message(role="user", content=value)]
    if not value:
        raise bad_param("input", "`input` must not be empty")
    out: list[Message] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool message
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, f"input[{i}]"))
        elif kind == "function_call":
            call = ToolCall(ToolCallFunction(_str(item, "name", i), _str(item, "arguments", i)),
                            id=_str(item, "call_id", i))
            names[call.id] = call.function.name
            if out and out[-1].role == "assistant" and out[-1].tool_calls and not out[-1].content:
                out[-1].tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                out.append(Message(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = _str(item, "call_id", i)
            out.append(Message(role="tool", content=_text(item.get("output"), f"input[{i}].output"),
                               tool_call_id=call_id, name=names.get(call_id)))
        else:
            raise bad_param(f"input[{i}].type", f"input item type {kind!r} is not supported; use 'message', "
                            "'function_call' or 'function_call_output'", code="unsupported_value")
    return out


def _message(item: dict, where: str) -> Message:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_param(f"{where}.role", f"unknown role {role!r}; expected user, system, developer or assistant")
    return Message(role=role, content=_text(item.get("content"), f"{where}.content"))


def _text(content: Any, where: str) -> str:
    return joined_text(content, where, kinds=("input_text", "output_text", "text"), part="{where}[{j}].type",
                       noun="content part")


def _str(item: dict, field: str, i: int) -> str:
    value = item.get(field)
    if not isinstance(value, str) or not value and field != "arguments":
        raise bad_param(f"input[{i}].{field}", f"`input[{i}].{field}` must be a non-empty string")
    return value


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's `{"type": "function", "function": {...}}`."""
    if tools is None:
        return None
    if len(tools) > agent_tools.MAX_TOOLS:  # before any schema is looked at
        raise bad_param("tools", f"at most {agent_tools.MAX_TOOLS} tools; got {len(tools)}")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            what = "built-in tool" if kind in BUILT_IN or str(kind).startswith(BUILT_IN) else "tool type"
            raise bad_param(f"tools[{i}].type", f"{what} {kind!r} is not supported; only 'function' tools are",
                            code="unsupported_value")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        fn.setdefault("parameters", {"type": "object", "properties": {}})
        schema_text(fn["parameters"], f"tools[{i}].parameters")  # checked first: a 400 names this API's field
        out.append({"type": "function", "function": fn})
    return out


def _choice(req: ResponsesRequest) -> str | dict[str, Any] | None:
    """Clients send `tool_choice: "auto"` with or without tools; without, a mode means nothing (a named
    function still gets chat's 400)."""
    if not req.tools and isinstance(req.tool_choice, str):
        return None
    return chat_tool_choice(req.tool_choice)


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_param("tool_choice", f"`tool_choice` {choice!r} is not supported; use 'none', 'auto', 'required' "
                    "or {'type': 'function', 'name': ...}", code="unsupported_value")


def chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format` (the same schema check and constrained decoding)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_param("text.format", "`text.format` must be an object")
    if fmt.get("type") == "json_schema":
        if "schema" in fmt:
            schema_text(fmt["schema"], "text.format.schema")  # checked first: a 400 names this API's field
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema") if k in fmt}}
    return fmt


def output_messages(output: list[dict]) -> list[Message]:
    """A response's output items as the assistant turn a continuation replays."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [ToolCall(ToolCallFunction(item["name"], item["arguments"]), id=item["call_id"])
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return [Message(role="assistant", content="")]
    return [Message(role="assistant", content=text or None, tool_calls=calls or None)]
