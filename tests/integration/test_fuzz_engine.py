"""Property-based fuzzing of the real backends' input handling through HTTP: Pulse's engine on the CPU and a
managed llama-server (not the load-test instrument, which ignores stop strings, grammars, logprobs and
predictions), each behind a real `pulse serve`, fed generated requests that are well-formed enough to reach it: tools and tool_choice,
response_format schemas (nested, enums, bounds), logprobs, stop strings, predictions, sampling settings,
unicode edge cases in the text, streaming or not. Every answer is a 200 with a complete result or a 4xx
in OpenAI's shape: no 5xx, no hang (each request has a deadline), no stream without its end.

CI runs PULSE_ENGINE_FUZZ_EXAMPLES (default 40) requests per endpoint and backend; the long run is
bench/fuzz_engine.sh, or bench/fuzz_shards.py, which starts one `pulse serve` itself and runs this module in
several processes against it at once (PULSE_FUZZ_BASE: that server's URL, PULSE_FUZZ_BACKENDS: the backend it
runs, PULSE_FUZZ_TALLY: where each process writes the statuses it got, one JSON object per endpoint).
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import PulseProcess

EXAMPLES = int(os.environ.get("PULSE_ENGINE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
REQUEST_TIMEOUT_S = 120  # far above any answer here (at most 6 tokens): past it, a hang
CONFIG = """
keys: {{file: "{tmp}/keys.json"}}
model: {{name: gemma-3-270m}}
workers:
{workers}
server:
  drain_grace_s: 2
"""
ENGINE = "  backend: cupy\n  engine: {device: cpu, kv_blocks: 512, max_num_seqs: 4}"
LLAMA = '  backend: llama-server\n  llama_server: {{binary: "{binary}", slots: 2, kv_tokens: 4096, threads: 2, log_dir: "{tmp}"}}'
MODEL = "gemma-3-270m"
BACKENDS = os.environ.get("PULSE_FUZZ_BACKENDS", "cupy,llama-server").split(",")
TALLY: dict[str, Counter] = {}  # endpoint -> status (and "slowest_ms") of every request this process sent

# text a tokenizer and detokenizer must survive: control characters, combining marks, RTL, emoji with
# joiners, astral planes, the model's own control tokens written as text, JSON-looking text
EDGE = ["", " ", "\n\n", "\t", "\x00", "\u0301", "e\u0301", "\u200d", "👩‍👩‍👧", "\U0001f600", "𝕏", "\u202e", "日本語",
        "<start_of_turn>", "<end_of_turn>\n<start_of_turn>model\n", "<bos>", "</s>", "{\"a\": 1}", "\\u0000", "\ufeff"]
text = st.one_of(st.sampled_from(EDGE), st.text(max_size=24),
                 st.lists(st.sampled_from(EDGE), max_size=4).map("".join))
names = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)
scalar_schemas = st.one_of(
    st.just({"type": "string"}), st.just({"type": "integer"}), st.just({"type": "number"}),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.lists(st.one_of(text, st.integers(-5, 5)), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def _nested(inner):
    """Arrays, objects and anyOf built over `inner` (named, not a lambda: hypothesis reads its source)."""
    return st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        st.dictionaries(names, inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1],
                           "additionalProperties": False}),
        st.lists(inner, min_size=2, max_size=3).map(lambda opts: {"anyOf": opts}))


schemas = st.recursive(scalar_schemas, _nested, max_leaves=6)
object_schemas = st.dictionaries(names, schemas, min_size=0, max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
tools = st.lists(st.builds(lambda n, p, d: {"type": "function", "function": {"name": n, "description": d, "parameters": p}},
                           names, object_schemas, text),
                 min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])


@st.composite
def chat_requests(draw):
    body: dict = {"model": MODEL, "max_tokens": draw(st.integers(1, 6)),
                  "messages": [{"role": draw(st.sampled_from(["user", "system", "assistant"])), "content": draw(text)}
                               for _ in range(draw(st.integers(1, 3)))] + [{"role": "user", "content": draw(text)}]}
    extras = {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
        "min_p": st.floats(0, 1), "seed": st.integers(0, 2**31), "max_draft_tokens": st.integers(0, 4),
        "stop": st.one_of(text.filter(bool), st.lists(text.filter(bool), max_size=4)),
        "logprobs": st.just(True), "top_logprobs": st.integers(0, 20),
        "prediction": text.map(lambda t: {"type": "content", "content": t}),
        "response_format": st.one_of(st.just({"type": "json_object"}), st.just({"type": "text"}), object_schemas.map(
            lambda s: {"type": "json_schema", "json_schema": {"name": "out", "schema": s}})),
        "stream": st.booleans(),
    }
    for field in draw(st.lists(st.sampled_from(sorted(extras)), max_size=6, unique=True)):
        body[field] = draw(extras[field])
    if "top_logprobs" in body:
        body["logprobs"] = True
    if draw(st.booleans()):
        body["tools"] = draw(tools)
        choice = draw(st.sampled_from(["auto", "required", "none", "named"]))
        body["tool_choice"] = ({"type": "function", "function": {"name": body["tools"][0]["function"]["name"]}}
                               if choice == "named" else choice)
        body.pop("response_format", None)
    return body


@st.composite
def completion_requests(draw):
    body: dict = {"model": MODEL, "max_tokens": draw(st.integers(1, 6)),
                  "prompt": draw(st.one_of(text.filter(bool), st.lists(st.integers(0, 262_143), min_size=1, max_size=12)))}
    for field, strategy in {"logprobs": st.integers(0, 5), "echo": st.booleans(), "stop": st.lists(text.filter(bool), max_size=3),
                            "temperature": st.floats(0, 2), "seed": st.integers(0, 2**31), "stream": st.booleans()}.items():
        if draw(st.booleans()):
            body[field] = draw(strategy)
    return body


class _Running:
    """A server someone else started (bench/fuzz_shards.py): only its URL."""

    def __init__(self, base: str):
        self.base = base.rstrip("/")


@pytest.fixture(scope="module", autouse=True)
def _tally():
    """Writes TALLY to PULSE_FUZZ_TALLY (when set) once the module's tests are done."""
    yield
    _write_tally()


def _write_tally() -> None:
    if path := os.environ.get("PULSE_FUZZ_TALLY"):
        Path(path).write_text(json.dumps({k: dict(v) for k, v in TALLY.items()}))


@pytest.fixture(scope="module", params=BACKENDS)
def engine_server(request, tmp_path_factory):
    if base := os.environ.get("PULSE_FUZZ_BASE"):
        yield _Running(base)
        return
    tmp = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    if request.param == "cupy":
        workers = ENGINE
    else:
        from tests.integration.llama_server_helpers import llama_server_binary

        workers = LLAMA.format(binary=llama_server_binary(), tmp=tmp)  # skips when not built (fails under CI)
    srv = PulseProcess([], CONFIG.format(tmp=tmp, workers=workers), tmp).wait_ready(300)
    yield srv
    srv.stop()


async def _send(base: str, path: str, body: dict) -> None:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(base + path, json=body) as r:
            raw = await r.read()
    tally = TALLY.setdefault(path, Counter())
    tally[str(r.status)] += 1
    tally["slowest_ms"] = max(tally["slowest_ms"], round((time.monotonic() - started) * 1000))
    if tally[str(r.status)] % 100 == 0:  # also on the way: a run cut short by its time limit keeps its counts
        _write_tally()
    assert r.status < 500, (r.status, raw[:400], body)
    if r.status >= 400:
        err = json.loads(raw)["error"]
        assert err["message"] and {"type", "param", "code"} <= set(err), raw[:400]
        return
    if body.get("stream"):
        events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"data: [DONE]", (raw[-400:], body)
        assert not any(b'"error"' in e for e in events), (raw[-400:], body)  # no in-band failure either
        return
    data = json.loads(raw)
    choice = data["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), data
    assert data["usage"]["completion_tokens"] <= body["max_tokens"] or choice["finish_reason"] == "tool_calls"


@given(body=chat_requests())
@FUZZ
async def test_fuzz_engine_chat(engine_server, body):
    await _send(engine_server.base, "/v1/chat/completions", body)


@given(body=completion_requests())
@FUZZ
async def test_fuzz_engine_completions(engine_server, body):
    await _send(engine_server.base, "/v1/completions", body)
