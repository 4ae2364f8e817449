"""The Responses and Messages adapters' pure parts: requests into chat messages, the model's text into each
protocol's items and events (streamed and whole agree, tool calls split out by the chat path's parser),
errors renamed to the caller's field names, and the in-process response store's bounds."""
from __future__ import annotations

import asyncio
import json

import pytest

from gateway.adapters import Splitter, decode_strict, renamed
from gateway.anthropic_api import MessagesRequest, anthropic_error_response, chat_messages, chat_tool_choice
from gateway.anthropic_events import MessagesEvents
from gateway.errors import APIError
from gateway.response_store import MemoryResponseStore
from gateway.responses_api import ResponsesRequest, input_messages, output_messages
from gateway.responses_events import ResponsesEvents
from gateway.tools import ChatPlan
from workers.protocol import Usage

WEATHER = {"name": "get_weather", "description": "", "parameters": {"type": "object"}}
AUTO = ChatPlan([WEATHER], "auto")
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def run(coro):
    return asyncio.run(coro)


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def stream(events, pieces: list[str], finish: str = "stop") -> list[tuple[str, dict]]:
    raw = b"".join(events.delta(p, None, i == 0) for i, p in enumerate(pieces))
    return sse_events(raw + run(events.end(finish, Usage(prompt_tokens=9, completion_tokens=5, cached_tokens=4))))


def responses_events(plan: ChatPlan, stored: list) -> ResponsesEvents:
    async def settle(response, output):
        stored.append(output)

    return ResponsesEvents({"id": "resp_1", "object": "response", "model": "m"}, Splitter(plan), settle)


def test_responses_text_stream_and_whole_agree():
    stored: list = []
    events = stream(responses_events(ChatPlan(), stored), ["Hel", "lo", " there"])
    kinds = [k for k, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and [e["sequence_number"] for _, e in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    whole = run(responses_events(ChatPlan(), stored).whole("Hello there", "stop", Usage(9, 5, 4), None))
    assert final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"] == "Hello there"
    assert whole["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    assert len(stored) == 2  # settled (stored) once each, before the end was written


def test_responses_function_call_events():
    events = stream(responses_events(AUTO, []), [CALL[:20], CALL[20:]])
    added = [e["item"] for k, e in events if k == "response.output_item.added"]
    assert [i["type"] for i in added] == ["function_call"] and added[0]["name"] == "get_weather"
    args = "".join(e["delta"] for k, e in events if k == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    (item,) = events[-1][1]["response"]["output"]
    assert item["arguments"] == args and item["call_id"].startswith("call_") and item["status"] == "completed"


def test_responses_length_is_incomplete():
    events = stream(responses_events(ChatPlan(), []), ["abc"], finish="length")
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_input_items_become_chat_turns():
    msgs = input_messages([{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                           {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                           {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "c2", "output": "42"}])
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert [c.id for c in msgs[1].tool_calls] == ["c1", "c2"]  # parallel calls: one assistant turn
    assert msgs[2].name == "g" and msgs[2].content == "42"
    back = output_messages([{"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c9"}])
    assert back[0].tool_calls[0].id == "c9" and back[0].content is None


def test_unknown_fields_are_400s_naming_them():
    with pytest.raises(APIError) as e:
        decode_strict(b'{"model": "m", "input": "x", "conversation": "c"}', ResponsesRequest)
    assert e.value.status == 400 and e.value.param == "conversation"
    with pytest.raises(APIError) as e:
        decode_strict(b'{"model": "m", "messages": []}', MessagesRequest)
    assert e.value.param == "max_tokens"


def test_renamed_maps_chat_params():
    names = [("messages", "input", False), ("response_format.json_schema.schema", "text.format.schema", True)]
    assert renamed(APIError(400, "x", param="messages[3].content"), names).param == "input"
    assert renamed(APIError(400, "x", param="response_format.json_schema.schema"), names).param == "text.format.schema"
    assert renamed(APIError(400, "x", param="model"), names).param == "model"


def test_anthropic_stream_and_whole_agree_on_tool_use():
    events = stream(MessagesEvents("msg_1", "m", 9, Splitter(AUTO)), [CALL[:15], CALL[15:]])
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[2][1]["content_block"]
    assert start["type"] == "tool_use" and start["input"] == {} and start["id"].startswith("toolu_")
    partial = "".join(e["delta"]["partial_json"] for k, e in events if k == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"] == {"input_tokens": 5, "output_tokens": 5, "cache_read_input_tokens": 4,
                              "cache_creation_input_tokens": 0}
    whole = run(MessagesEvents("msg_1", "m", 9, Splitter(AUTO)).whole(CALL, "stop", Usage(9, 5, 4), None))
    assert whole["content"][0]["input"] == json.loads(partial) == {"city": "Paris"}


def test_anthropic_text_in_auto_mode_is_text():
    whole = run(MessagesEvents("msg_1", "m", 9, Splitter(AUTO)).whole("Sunny.", "length", Usage(9, 5), None))
    assert whole["content"] == [{"type": "text", "text": "Sunny."}] and whole["stop_reason"] == "max_tokens"


def test_anthropic_turns_become_chat_messages():
    msgs = chat_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"},
                                     {"type": "text", "text": "and tomorrow?"}]}])
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "user"]
    assert msgs[1].tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert msgs[2].name == "get_weather" and msgs[2].tool_call_id == "toolu_1"
    with pytest.raises(APIError) as e:
        chat_messages([{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.param == "messages.0.content.0.type"
    assert chat_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)


def test_anthropic_error_shape():
    resp = anthropic_error_response(APIError(429, "slow down", code="rate_limited", headers={"Retry-After": "3"}))
    assert resp.status == 429 and resp.headers["Retry-After"] == "3"
    assert json.loads(resp.body) == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}


def test_memory_store_is_bounded_by_bytes():
    store = MemoryResponseStore(ttl_s=60, max_bytes=100, memory_bytes=250)
    assert not run(store.put("big", b"x" * 101))  # over the entry bound: refused, not truncated
    for i in range(5):
        assert run(store.put(f"r{i}", b"y" * 100))
    held = [i for i in range(5) if run(store.get(f"r{i}")) is not None]
    assert held == [3, 4]  # 250 bytes hold two entries; the oldest went first
    assert run(store.delete("r4")) and run(store.get("r4")) is None


def test_responses_failure_before_output_still_opens_the_stream():
    events = sse_events(responses_events(ChatPlan(), []).error("worker failed"))
    assert [k for k, _ in events] == ["response.created", "response.failed"]
    failed = events[1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "worker failed"


def test_too_many_tools_are_refused_before_their_schemas_are_read():
    from gateway.anthropic_api import chat_tools as anthropic_tools
    from gateway.responses_api import chat_tools as responses_tools

    many = [{"type": "function", "name": f"f{i}", "parameters": {"type": "strnig"}} for i in range(129)]
    for convert in (responses_tools, anthropic_tools):
        with pytest.raises(APIError) as e:
            convert([dict(t, type="function") if convert is responses_tools else
                     {"name": t["name"], "input_schema": t["parameters"]} for t in many])
        assert e.value.param == "tools" and "at most 128" in e.value.message


def test_message_text_parts_are_joined_and_other_parts_named_in_each_api():
    """Both adapters read message text through adapters.joined_text: a string or text parts joined; another
    part type is a 400 naming its path in that API's own notation."""
    msgs = input_messages([{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]}])
    assert msgs[0].content == "ab"
    with pytest.raises(APIError) as e:
        input_messages([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    assert e.value.status == 400 and e.value.param == "input[0].content[0].type"
    assert "'input_image' is not supported; use 'input_text'" in e.value.message
    with pytest.raises(APIError) as e:
        input_messages([{"role": "user", "content": 7}])
    assert e.value.param == "input[0].content"
    def result(content):  # a tool result's content: text through the same helper
        return chat_messages([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                            "content": content}]}])

    assert result([{"type": "text", "text": "x"}, {"type": "text", "text": "y"}])[0].content == "xy"
    with pytest.raises(APIError) as e:
        result([{"type": "image", "source": {}}])
    assert e.value.param == "messages.0.content.0.content.0.type" and "use 'text'" in e.value.message
