"""Anthropic's Messages API with the official `anthropic` client against a real `pulse serve` (Pulse's engine
on CPU, an API key sent as `x-api-key`): messages.create and .stream that agree, a tool_use -> tool_result
-> answer loop, count_tokens against the served prompt, bad input as Anthropic-shaped 4xx errors, and the
same API (plus the Responses API) on the llama-server backend."""
from __future__ import annotations

import json
import subprocess
import sys

import anthropic
import jsonschema
import openai
import pytest
import requests

from tests.conftest import PulseProcess

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Write one short sentence about the sea."}]
GREEDY = {"temperature": 0}  # current SDKs no longer send sampling knobs; older clients do, and Pulse takes them
ENGINE = """
model: {{name: gemma-3-270m}}
keys: {{file: "{tmp}/keys.json"}}
workers:
  backend: cupy
  count: 1
  engine: {{device: cpu, kv_blocks: 512, max_num_seqs: 4}}
server:
  drain_grace_s: 2
"""


def keyed_server(config: str, tmp) -> tuple[PulseProcess, str]:
    key = subprocess.run([sys.executable, "-m", "pulse.cli", "keys", "create", "--keys-file", str(tmp / "keys.json")],
                         check=True, capture_output=True, text=True).stdout.strip()
    return PulseProcess([], config, tmp).wait_ready(300), key


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic")
    srv, key = keyed_server(ENGINE.format(tmp=tmp), tmp)
    try:
        yield srv, key
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    srv, key = server
    return anthropic.Anthropic(base_url=srv.base, api_key=key, timeout=120, max_retries=0)


def create(client, **kw):
    kw = {"messages": ASK, "max_tokens": 12, "extra_body": GREEDY, **kw}
    return client.messages.create(model=MODEL, **kw)


def test_create_has_text_and_usage(client):
    m = create(client)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert [b.type for b in m.content] in (["text"], [])
    assert 0 < m.usage.output_tokens <= 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 5
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 12


def test_stream_agrees_with_create(client):
    whole = create(client, system="Answer briefly.")
    with client.messages.stream(model=MODEL, messages=ASK, max_tokens=12, extra_body=GREEDY, system="Answer briefly.") as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
        text = s.get_final_text()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert text == "".join(b.text for b in whole.content)  # greedy: the same text either way
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_event_order(server):
    """The wire itself: named events in Anthropic's order, a ping after message_start."""
    srv, key = server
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": True}
    r = requests.post(srv.base + "/v1/messages", json=body, timeout=120, stream=True,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    names = [line.split(": ", 1)[1] for line in r.iter_lines(decode_unicode=True) if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    assert names.count("content_block_start") == names.count("content_block_stop") <= 1


def test_tool_use_result_answer_loop(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = create(client, messages=messages, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
               max_tokens=40)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    messages += [{"role": "assistant", "content": m.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": '{"temperature_c": 21, "sky": "clear"}'}]}]
    answer = create(client, messages=messages, tools=TOOLS, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in answer.content)
    # the answer's prompt holds the call and its result, beyond the question alone
    question = client.messages.count_tokens(model=MODEL, messages=messages[:1]).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > question + 20


def test_streamed_tool_use_input(client):
    with client.messages.stream(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                max_tokens=40, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "any"}) as s:
        partial = "".join(e.partial_json for e in s if e.type == "input_json")
        final = s.get_final_message()
    (use,) = final.content
    assert use.type == "tool_use" and final.stop_reason == "tool_use"
    assert json.loads(partial) == use.input
    jsonschema.validate(use.input, WEATHER)


def test_output_config_json_schema(client):
    m = create(client, messages=[{"role": "user", "content": "A city."}], max_tokens=40,
               output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(json.loads(m.content[0].text), WEATHER)


def test_count_tokens_is_the_served_prompt(client):
    kw = {"messages": [{"role": "user", "content": "Count these words, please."}], "system": "Be brief.",
          "tools": TOOLS}
    counted = client.messages.count_tokens(model=MODEL, **kw).input_tokens
    m = create(client, max_tokens=1, **kw)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens < counted


def test_bad_input_is_an_anthropic_4xx(server, client):
    srv, key = server
    cases = [({"max_tokens": 0}, "max_tokens"),
             ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
             ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
             ({"tools": [{"name": "f", "input_schema": {"type": "strnig"}}]}, "tools.0.input_schema"),
             ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
             ({"output_config": {"effort": "high"}}, "output_config.effort"),
             ({"extra_body": {"frobnicate": 1}}, "frobnicate")]
    for kw, param in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            create(client, **kw)
        body = e.value.body
        assert e.value.status_code == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and param in body["error"]["message"], (param, body)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nonexistent", messages=ASK, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    bad_key = anthropic.Anthropic(base_url=srv.base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        create(bad_key)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": e.value.body["error"]["message"]}}
    r = requests.post(srv.base + "/v1/messages", data=b"{not json", headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_llama_server_backend_speaks_both(tmp_path):
    """The adapters sit above the backend: a short pass of both APIs on llama-server."""
    from tests.integration.llama_server_helpers import llama_server_binary

    binary = llama_server_binary()  # skips where it is not built (fails under CI)
    config = f"""
model: {{name: gemma-3-270m}}
keys: {{file: "{tmp_path}/keys.json"}}
workers:
  backend: llama-server
  llama_server: {{binary: "{binary}", slots: 2, kv_tokens: 4096, threads: 2, log_dir: "{tmp_path}"}}
server:
  drain_grace_s: 2
"""
    srv, key = keyed_server(config, tmp_path)
    try:
        a = anthropic.Anthropic(base_url=srv.base, api_key=key, timeout=120, max_retries=0)
        with a.messages.stream(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                               max_tokens=40, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "any"}) as s:
            final = s.get_final_message()
        jsonschema.validate(final.content[0].input, WEATHER)
        o = openai.OpenAI(base_url=srv.base + "/v1", api_key=key, timeout=120, max_retries=0)
        first = o.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0)
        events = list(o.responses.create(model=MODEL, input="Say more.", previous_response_id=first.id,
                                         max_output_tokens=6, temperature=0, stream=True))
        assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                               "response.incomplete")
        assert events[-1].response.usage.input_tokens > first.usage.input_tokens
    finally:
        srv.stop()
