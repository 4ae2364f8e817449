"""Structured outputs: `response_format` and forced tool calls as one JSON schema the worker enforces.

The worker gets the schema as JSON text (GenerateRequest.grammar): Pulse's engine compiles it into a
token mask with llguidance, llama-server turns it into its own grammar. The gateway checks every schema
first, with the same library and options the engine uses, so a schema that cannot be compiled is a 400
naming the parameter, before any worker is touched.

Compiling a large schema takes up to ~1 s of CPU, so it never runs on the event loop of a serving
gateway: inside `deferred()` (the chat core opens it around each request's parsing) `schema_text` only
canonicalizes and size-checks, and `SchemaChecker.check` then compiles the collected schemas on a small
thread pool (llguidance releases the GIL while it compiles), with limits, each a 400 naming its reason:
MAX_SCHEMA_BYTES per schema, MAX_REQUEST_SCHEMA_BYTES per request, COMPILE_TIMEOUT_S per compile; at most
MAX_PENDING compiles run or wait at once (503 past that). Verdicts are cached by the schema text's
SHA-256 (a bounded LRU; a schema that timed out is remembered as too slow). Outside `deferred()` (unit
tests, tools) `schema_text` compiles inline, through the same cache; inside `cached_only()` it applies
cached verdicts only (the chat core parses a request again that way when a deferred check failed, so that
each API adapter names the parameter in its own words).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cachetools
import llguidance as llg
import msgspec

from gateway.errors import APIError, bad_param

MAX_SCHEMA_BYTES = 64 * 1024  # a 190 KB schema took ~0.9 s to check on the 2-core box: refuse before that
MAX_REQUEST_SCHEMA_BYTES = 1024 * 1024  # all of one request's schemas (up to 128 tools)
COMPILE_TIMEOUT_S = 2.0
COMPILE_WORKERS = 2
MAX_PENDING = 16
COMPILE_NICE = 10
ANY_OBJECT = '{"type": "object"}'
# Must match workers/cupy/constrain.py (the gateway may not import a backend): layout of generated JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_LIMITS = dict(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=2_000_000)
_TOO_SLOW = f"it took longer than {COMPILE_TIMEOUT_S:g} s to compile"

_encode = msgspec.json.Encoder().encode
_pending: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("pulse_schemas", default=None)
_CACHED_ONLY: list = []
_verdicts: cachetools.LRUCache = cachetools.LRUCache(maxsize=4096)  # sha256(text) -> None (compiles) or why not
_verdicts_lock = threading.Lock()  # inline checks may run on executor threads


@contextlib.contextmanager
def deferred():
    """Collect the (schema text, parameter) pairs `schema_text` sees, for `SchemaChecker.check`, instead
    of compiling them where they are met."""
    pending: list[tuple[str, str]] = []
    token = _pending.set(pending)
    try:
        yield pending
    finally:
        _pending.reset(token)


@contextlib.contextmanager
def cached_only():
    """`schema_text` applies verdicts already cached and compiles nothing: to raise a failed check again
    where the request is parsed (an API adapter names the parameter in its own words)."""
    token = _pending.set(_CACHED_ONLY)
    try:
        yield
    finally:
        _pending.reset(token)


def schema_text(schema: Any, param: str) -> str:
    """Canonical JSON text of a schema object; a 400 naming `param` if it is not one, is too large, or (when
    not deferred) cannot be compiled."""
    if not isinstance(schema, dict):
        raise bad_param(param, f"`{param}` must be a JSON Schema object")
    try:
        text = _encode(schema).decode()  # msgspec: ~5x faster than json.dumps on a 1 MB schema, on the event loop
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as e:
        raise bad_param(param, f"`{param}` cannot be used as a JSON schema: {e}") from None
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise bad_param(param, f"`{param}` is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted",
                        code="schema_too_large")
    pending = _pending.get()
    if pending is None:
        _raise_if_bad(param, _verdict(text))
    elif pending is _CACHED_ONLY:
        with _verdicts_lock:
            known = _verdicts.get(_key(text))
        _raise_if_bad(param, known)
    else:
        pending.append((text, param))
    return text


def _key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _verdict(text: str) -> str | None:
    key = _key(text)
    with _verdicts_lock:
        if key in _verdicts:
            return _verdicts[key]
    error = compile_error(text)
    with _verdicts_lock:
        _verdicts[key] = error
    return error


def _raise_if_bad(param: str, error: str | None) -> None:
    """The 400 for a failed verdict: codes schema_too_complex (timed out) and invalid_schema."""
    if error == _TOO_SLOW:
        raise bad_param(param, f"`{param}` is too complex: {error}", code="schema_too_complex")
    if error:
        raise bad_param(param, f"`{param}` cannot be used for constrained decoding: {error}", code="invalid_schema")


def compile_error(text: str) -> str | None:
    """Why llguidance cannot compile this schema (None when it can)."""
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as e:
        return str(e)[:1000]
    limits = llg.LLParserLimits(**_LIMITS)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=limits)
    return ("; ".join(messages)[:1000] or "invalid schema") if is_error else None


def _lower_priority() -> None:
    """Compile threads yield the CPU to the event loop's thread (Linux nice values are per thread): on a
    2-core box two compiles at normal priority stretched other streams' token gaps past 100 ms."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (OSError, AttributeError):  # not Linux, or not permitted: compiles still run off the loop
        pass


class SchemaChecker:
    """Compiles a request's schemas off the event loop: `await checker.check(pending)` raises the 400 (or
    the 503 when MAX_PENDING compiles are already under way) for the first that fails."""

    def __init__(self, workers: int = COMPILE_WORKERS, max_pending: int = MAX_PENDING,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pulse-schema",
                                        initializer=_lower_priority)
        self._slots = threading.BoundedSemaphore(max_pending)  # released by the compile itself, when it ends
        self.timeout_s = timeout_s

    async def check(self, pending: list[tuple[str, str]]) -> None:
        total = sum(len(text.encode()) for text, _ in pending)
        if total > MAX_REQUEST_SCHEMA_BYTES:
            raise APIError(400, f"the request's schemas total {total} bytes; at most {MAX_REQUEST_SCHEMA_BYTES} "
                           "are accepted", param="tools", code="schema_too_large")
        seen: set[bytes] = set()
        for text, param in pending:
            key = _key(text)
            if key not in seen:
                seen.add(key)
                _raise_if_bad(param, await self._verdict(key, text))

    async def _verdict(self, key: bytes, text: str) -> str | None:
        with _verdicts_lock:
            if key in _verdicts:
                return _verdicts[key]
        if not self._slots.acquire(blocking=False):
            raise APIError(503, "the gateway is compiling too many schemas at once; retry shortly",
                           code="schema_compiler_busy", headers={"Retry-After": "1"})
        future = self._pool.submit(self._compile, key, text)
        try:
            # shielded: a timeout or a client that leaves must not cancel a compile that has not started
            # yet (its slot is given back only when it runs)
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except TimeoutError:
            # the compile runs on (threads cannot be stopped) and holds its slot until it ends; remember
            # the schema as too slow so that resending it costs nothing
            with _verdicts_lock:
                _verdicts[key] = _TOO_SLOW
            return _TOO_SLOW

    def _compile(self, key: bytes, text: str) -> str | None:
        try:
            error = compile_error(text)
            with _verdicts_lock:
                if _verdicts.get(key) != _TOO_SLOW:
                    _verdicts[key] = error
            return error
        finally:
            self._slots.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
