"""Structured outputs: `response_format` and forced tool calls as one JSON schema the worker enforces.

The worker gets the schema as JSON text (GenerateRequest.grammar): Pulse's engine compiles it into a
token mask with llguidance, llama-server turns it into its own grammar. The gateway checks every schema
here first, with the same library and options the engine uses, so a schema that cannot be compiled is a
400 naming the parameter, before any worker is touched. Checks are cached per schema text, and bounded:
a schema larger than MAX_SCHEMA_BYTES is refused unread, and llguidance's own size limits cap the rest.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import llguidance as llg

from gateway.errors import bad_param

MAX_SCHEMA_BYTES = 64 * 1024  # a 190 KB schema took ~0.9 s to check on the 2-core box: refuse before that
ANY_OBJECT = '{"type": "object"}'
# Must match workers/cupy/constrain.py (the gateway may not import a backend): layout of generated JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_LIMITS = dict(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=2_000_000)


def schema_text(schema: Any, param: str) -> str:
    """Canonical JSON text of a schema object, after checking it compiles; a 400 naming `param` if not."""
    if not isinstance(schema, dict):
        raise bad_param(param, f"`{param}` must be a JSON Schema object")
    try:
        text = json.dumps(schema, separators=(", ", ": "), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise bad_param(param, f"`{param}` cannot be used as a JSON schema: {e}") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise bad_param(param, f"`{param}` is {len(text.encode())} bytes; at most {MAX_SCHEMA_BYTES} are accepted",
                        code="schema_too_large")
    error = _compile_error(text)
    if error:
        raise bad_param(param, f"`{param}` cannot be used for constrained decoding: {error}", code="invalid_schema")
    return text


@functools.lru_cache(maxsize=1024)
def _compile_error(text: str) -> str | None:
    """Why llguidance cannot compile this schema (None when it can). Cached: agents resend one schema."""
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as e:
        return str(e)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=llg.LLParserLimits(**_LIMITS))
    return "; ".join(messages) or "invalid schema" if is_error else None


def response_format_grammar(rf: dict[str, Any] | None) -> str | None:
    """The schema text `response_format` asks for, or None for plain text."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_param("response_format.json_schema", "`response_format.json_schema` must be an object "
                            "with `name` and `schema`")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_param("response_format.json_schema.name", "`response_format.json_schema.name` must be a string")
        if "schema" not in spec:
            raise bad_param("response_format.json_schema.schema", "`response_format.json_schema.schema` is required")
        return schema_text(spec["schema"], "response_format.json_schema.schema")
    raise bad_param("response_format.type", f"unknown `response_format.type` {kind!r}; expected 'text', "
                    "'json_object' or 'json_schema'")


def tool_call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The schema of one call to one of `functions` ({"name", "parameters"} each): name first, then arguments,
    so the name can be streamed before the arguments are written."""
    options = [{"type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}
