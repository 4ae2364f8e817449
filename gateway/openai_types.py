"""OpenAI request shapes (msgspec) and their validation into 400s that name the parameter.

Unknown top-level fields are accepted and ignored (clients send `user`, `metadata`, `store`, ...);
known fields are type-checked by msgspec and range-checked here.
"""
from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from gateway.errors import APIError, bad_param
from workers.request_limits import SAMPLING_RANGES

ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: str = ""


class ToolCall(msgspec.Struct):
    function: ToolCallFunction
    id: str = ""
    type: str = "function"


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Prediction(msgspec.Struct):
    type: str
    content: str | list[ContentPart]


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_draft_tokens: int | None = None
    prediction: Prediction | None = None
    ignore_eos: bool = False
    priority: int | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a one-element list of either (msgspec allows one array type)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Parse a request body; malformed JSON and wrong types become 400s naming the parameter."""
    if not body:
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH.search(text)
        param = m.group(1) if m else None
        if param is None and "missing required field" in text:
            param = text.split("`")[1] if "`" in text else None
        raise APIError(400, f"invalid request: {text}", param=param or None, code="invalid_type") from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None


def _range(name: str, value: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if value != value or value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_param(name, f"`{name}` must be in {bound}; got {value}")


def validate_common(req: _Common, *, max_stop_strings: int, max_stop_length: int) -> None:
    if not req.model:
        raise bad_param("model", "`model` must be a non-empty string")
    for name, lo, hi, lo_open in SAMPLING_RANGES:  # the bounds every worker checks again itself
        _range(name, getattr(req, name), lo, hi, lo_open=lo_open)
    if req.top_k is not None and req.top_k < 0:
        raise bad_param("top_k", f"`top_k` must be >= 0; got {req.top_k}")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_param("max_tokens", f"`max_tokens` must be >= 1; got {req.max_tokens}")
    if req.n is not None and req.n != 1:
        raise bad_param("n", f"only `n` = 1 is supported; got {req.n}", code="unsupported_value")
    if req.max_draft_tokens is not None and not 0 <= req.max_draft_tokens <= 64:
        raise bad_param("max_draft_tokens", f"`max_draft_tokens` must be in [0, 64]; got {req.max_draft_tokens}")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_param("seed", "`seed` must fit in 64 bits")
    stops = stop_list(req.stop)
    if len(stops) > max_stop_strings:
        raise bad_param("stop", f"at most {max_stop_strings} stop strings; got {len(stops)}")
    if any(len(s) > max_stop_length for s in stops):
        raise bad_param("stop", f"stop strings may be at most {max_stop_length} characters")
    if any(not s for s in stops):
        raise bad_param("stop", "stop strings must be non-empty")
    if req.prediction is not None and req.prediction.type != "content":
        raise bad_param("prediction.type", "`prediction.type` must be 'content'")


def validate_chat(req: ChatRequest, *, max_messages: int, **limits: int) -> None:
    validate_common(req, **limits)
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_param("max_completion_tokens", f"`max_completion_tokens` must be >= 1; got {req.max_completion_tokens}")
    if not req.messages:
        raise bad_param("messages", "`messages` must contain at least one message")
    if len(req.messages) > max_messages:
        raise bad_param("messages", f"at most {max_messages} messages; got {len(req.messages)}")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise bad_param(f"messages[{i}].role", f"unknown role {m.role!r}; expected one of {', '.join(ROLES)}")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_param(
                        f"messages[{i}].content[{j}]", f"content part type {part.type!r} is not supported; use 'text'"
                    )
        if m.content is None and not m.tool_calls:
            raise bad_param(f"messages[{i}].content", "message content is required")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= 20:
            raise bad_param("top_logprobs", f"`top_logprobs` must be in [0, 20]; got {req.top_logprobs}")
        if not req.logprobs:
            raise bad_param("top_logprobs", "`top_logprobs` requires `logprobs: true`")


def validate_completion(req: CompletionRequest, **limits: int) -> None:
    validate_common(req, **limits)
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_param("logprobs", f"`logprobs` must be in [0, 20]; got {req.logprobs}")
    if req.suffix:
        raise bad_param("suffix", "`suffix` is not supported", code="unsupported_parameter")
    p = req.prompt
    if isinstance(p, list):
        if not p:
            raise bad_param("prompt", "`prompt` must not be empty")
        if len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        elif not all(type(t) is int for t in p):
            raise bad_param("prompt", "`prompt` must be a string, a list of token ids, or a list of one of those "
                            "(one prompt per request)", code="unsupported_value")
    if isinstance(p, list) and (not p or not all(type(t) is int for t in p)):
        raise bad_param("prompt", "`prompt` token lists must be non-empty lists of integers")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def text_of(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content)


FinishReason = Literal["stop", "length", "tool_calls"]
