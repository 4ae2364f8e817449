"""The agent-facing API with the official `openai` client against a real `pulse serve`, on both backends
(Pulse's engine on CPU, and llama-server on CPU where it is built): forced tool calls whose arguments
validate against the function's schema, streamed tool calls that reassemble to the same call,
json_schema / json_object responses that validate, logprobs with the requested alternatives, tool
results accepted back, and bad agent input as 400s naming the parameter."""
from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import openai
import pytest

from tests.conftest import PulseProcess

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
               "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "languages": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                         "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}


def engine_config(tmp) -> str:
    return f"""
keys: {{file: "{tmp}/keys.json"}}
model: {{name: gemma-3-270m}}  # one model (a config naming none serves both bundled ones)
workers:
  backend: cupy
  engine: {{device: cpu, kv_blocks: 512, max_num_seqs: 4}}
server:
  drain_grace_s: 5
"""


def llama_server_config(tmp) -> str:
    from tests.integration.llama_server_helpers import llama_server_binary

    binary = llama_server_binary()  # skips when not built
    return f"""
keys: {{file: "{tmp}/keys.json"}}
model: {{name: gemma-3-270m}}  # one model (a config naming none serves both bundled ones)
workers:
  backend: llama-server
  llama_server: {{binary: "{binary}", slots: 2, kv_tokens: 4096, threads: 2, log_dir: "{tmp}"}}
server:
  drain_grace_s: 5
"""


@pytest.fixture(scope="module", params=["cupy", "llama-server"])
def client(request, tmp_path_factory):
    """One server per backend for the whole module (each takes ~30 s to start)."""
    tmp = tmp_path_factory.mktemp(f"agent-{request.param}")
    config = (engine_config if request.param == "cupy" else llama_server_config)(tmp)
    key = subprocess.run([sys.executable, "-m", "pulse.cli", "keys", "create", "--keys-file", str(tmp / "keys.json")],
                         check=True, capture_output=True, text=True).stdout.strip()
    srv = PulseProcess([], config, tmp).wait_ready(300)
    try:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key=key, timeout=240, max_retries=0)
    finally:
        srv.stop()


def forced(client, choice, stream=False, **kw):
    return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                          temperature=0, max_tokens=80, stream=stream, **kw)


def check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_named_tool_call_parses_and_validates(client):
    r = forced(client, {"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    check_call("get_weather", call.function.arguments)


def test_required_tool_call_picks_a_declared_function(client):
    r = forced(client, "required")
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        check_call(call.function.name, call.function.arguments)


def test_streamed_tool_call_reassembles_to_the_whole_one(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = forced(client, choice).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in forced(client, choice, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.id or entry["id"]
            if d.function is not None:
                entry["name"] = d.function.name or entry["name"]
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == whole.function.name
    assert calls[0]["arguments"] == whole.function.arguments  # greedy: the same call, piece by piece
    check_call("get_weather", calls[0]["arguments"])


def test_json_schema_response_validates(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Describe a software engineer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_response_is_an_object(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the colour of the sky as JSON with one key."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")


def test_chat_logprobs_have_the_requested_alternatives(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and e.logprob == pytest.approx(tops[0], abs=1e-3)  # greedy


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 and t for t in lp.top_logprobs)  # two alternatives (they can share a text)


def test_penalties_reach_the_backend(client):
    # greedy repeats "the cat"; with OpenAI's penalties the same request must not (both backends honour them)
    prompt = "the cat the cat the cat the cat the cat the cat the cat the cat"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12).choices[0].text
    steered = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                        frequency_penalty=2.0, presence_penalty=1.0).choices[0].text
    assert steered != plain and plain.count("cat") > steered.count("cat"), (plain, steered)


def test_tool_results_are_accepted_back(client):
    call = forced(client, {"type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    message = r.choices[0].message
    assert message.content or message.tool_calls
    for c in message.tool_calls or []:
        assert c.function.name in SCHEMAS


@pytest.mark.parametrize("kw,param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools[0].function.parameters"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}),
     "response_format.json_schema.schema"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
])
def test_bad_agent_input_is_a_400_naming_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_openai_client_models_chat_and_completions(client):
    """The foundation's done-when: list models, chat (stream and not) and complete with the official client."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens >= 1 and chat.choices[0].finish_reason in ("stop", "length")
    parts = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                                max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert streamed == chat.choices[0].message.content  # temperature 0: the same text either way
    assert parts[-1].usage.completion_tokens == chat.usage.completion_tokens
    # A prompt whose continuation is no near-tie: llama-server's logits for a prompt computed whole and for one
    # found in a slot's cache may differ in the last bits (its docs on cache_prompt), and "def add(a, b):"
    # put "print" and "return" close enough to flip with the instruction set the binary was built for.
    prompt = "1, 2, 3, 4, 5,"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert done.choices[0].text and done.usage.prompt_tokens > 0
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text
