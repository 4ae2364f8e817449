"""Tool calls: request validation into 400s, the prompt block, and parsing the model's text into
OpenAI tool_calls (whole and streamed in arbitrary pieces, which must agree)."""
from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import APIError
from gateway.openai_types import ChatRequest, Message
from gateway.responses import Shaper
from gateway.tool_parser import ToolCallStream, parse_tool_calls
from gateway.tools import ToolShaper, instructions, plan_chat, prompt_messages
from workers.protocol import Usage

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(**kw) -> ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return msgspec.json.decode(json.dumps(body), type=ChatRequest)


def bad(param: str, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        plan_chat(chat(**kw))
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


# ---- plans and 400s ---------------------------------------------------------------------------------
def test_auto_is_the_default_and_leaves_decoding_free():
    plan = plan_chat(chat(tools=[WEATHER, CLOCK]))
    assert plan.mode == "auto" and plan.grammar is None and plan.names == {"get_weather", "get_time"}


def test_none_leaves_tools_out():
    assert plan_chat(chat(tools=[WEATHER], tool_choice="none")).mode == "none"


def test_named_choice_constrains_to_that_function():
    plan = plan_chat(chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert plan.mode == "forced" and [f["name"] for f in plan.functions] == ["get_time"]
    schema = json.loads(plan.grammar)
    assert schema["properties"]["name"] == {"const": "get_time"}
    assert list(schema["properties"]) == ["name", "arguments"]  # name first: it streams before the arguments


def test_required_allows_any_of_the_functions():
    schema = json.loads(plan_chat(chat(tools=[WEATHER, CLOCK], tool_choice="required")).grammar)
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]


def test_bad_tool_input_names_the_parameter():
    bad("tool_choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    bad("tool_choice", tools=[WEATHER], tool_choice="sometimes")
    bad("tool_choice", tool_choice="auto")
    bad("tools[0].function.parameters", tools=[{"type": "function", "function": {"name": "f"}}])
    bad("tools[1].function.name", tools=[WEATHER, {"type": "function", "function": {"name": "bad name!", "parameters": {}}}])
    bad("tools[1].function.name", tools=[WEATHER, WEATHER])
    bad("tools[0].type", tools=[{"type": "retrieval"}])
    bad("tools[0].function.parameters",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])


def test_instructions_list_every_function_schema():
    plan = plan_chat(chat(tools=[WEATHER, CLOCK]))
    text = instructions(plan)
    for tool in (WEATHER, CLOCK):
        assert json.dumps(tool["function"]["parameters"]) in text
    assert '"arguments"' in text


def test_prompt_folds_instructions_into_the_system_message():
    plan = plan_chat(chat(tools=[WEATHER]))
    msgs = prompt_messages([Message(role="system", content="Be brief."), Message(role="user", content="hi")], plan)
    assert msgs[0].role == "system" and msgs[0].content.startswith("Be brief.\n\n") and "get_weather" in msgs[0].content
    msgs = prompt_messages([Message(role="user", content="hi")], plan)
    assert [m.role for m in msgs] == ["system", "user"]


# ---- parsing --------------------------------------------------------------------------------------
NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '  ```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '{"name":"get_weather","parameters":{"city":"Paris"}}',
])
def test_one_call_in_the_usual_shapes(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "" and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")


def test_several_calls_with_nested_and_escaped_arguments():
    text = ('[{"name": "get_weather", "arguments": {"city": "a \\"}{\\" b", "x": [1, {"y": "]"}]}}, '
            '{"name": "get_time", "arguments": {}}]')
    _, calls = parse_tool_calls(text, NAMES)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": 'a "}{" b', "x": [1, {"y": "]"}]}
    assert calls[1].arguments == "{}"
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", ["The weather is fine.", '{"answer": 42}', '{"name": "unknown_fn", "arguments": {}}',
                                  "``` not a fence", "[1, 2, 3]"])
def test_text_that_is_not_a_known_call_is_content(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert calls == [] and content == text


def test_truncated_arguments_stay_partial():
    _, calls = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Par', NAMES)
    assert calls[0].arguments == '{"city": "Par'


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=40),
       st.sampled_from(['{"name": "get_weather", "arguments": {"city": "Zürich \\u00e9", "unit": "c"}}',
                        '```json\n[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": '
                        '{"city": "x"}}]\n```', "Plain answer, no call at all.", '{"not": "a call"}']))
def test_streamed_pieces_reassemble_to_the_whole_parse(cuts, text):
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    stream, content, args, names, pos = ToolCallStream(NAMES), "", {}, {}, 0
    pieces = []
    for n in cuts:
        pieces.append(text[pos:pos + n])
        pos += n
    pieces.append(text[pos:])
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    for d in deltas:
        content += d.content
        for entry in d.tool_calls:
            fn = entry["function"]
            if "name" in fn:
                names[entry["index"]] = fn["name"]
            args[entry["index"]] = args.get(entry["index"], "") + fn.get("arguments", "")
    assert content == whole_content
    assert [names[i] for i in sorted(names)] == [c.name for c in whole_calls]
    assert [args[i] for i in sorted(args)] == [c.arguments for c in whole_calls]


# ---- response shapes ------------------------------------------------------------------------------
def test_whole_response_has_tool_calls_and_finish_reason():
    shaper = ToolShaper(Shaper("chat", "chatcmpl-1", 0, "m", str), plan_chat(chat(tools=[WEATHER])))
    body = shaper.whole('{"name": "get_weather", "arguments": {"city": "Oslo"}}', "stop", Usage(), None)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_streamed_chunks_carry_tool_call_deltas():
    shaper = ToolShaper(Shaper("chat", "chatcmpl-1", 0, "m", str), plan_chat(chat(tools=[WEATHER])))
    first = shaper.stream_chunk('{"name": "get_weather", "argu', None, None, True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    mid = shaper.stream_chunk('ments": {"city": "Oslo"', None, None, False)
    entry = mid["choices"][0]["delta"]["tool_calls"][0]
    assert entry["index"] == 0 and entry["id"].startswith("call_") and entry["function"]["name"] == "get_weather"
    assert entry["function"]["arguments"] == '{"city": "Oslo"'
    last = shaper.stream_chunk("}}", "stop", None, False)
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert last["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": "}"}}]


def test_plain_answers_pass_through_unchanged():
    shaper = ToolShaper(Shaper("chat", "chatcmpl-1", 0, "m", str), plan_chat(chat(tools=[WEATHER])))
    body = shaper.whole("It is sunny.", "stop", Usage(), None)
    assert body["choices"][0]["message"]["content"] == "It is sunny." and body["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in body["choices"][0]["message"]
