"""Streamed text deltas are built from pre-encoded bytes around the text: byte for byte the full encoding."""
from __future__ import annotations

import msgspec
import pytest

from gateway.completions import ChatEvents
from gateway.responses import Shaper

TEXTS = [" tok", "a\"b\\c", "line\nbreak\ttab", "é漢字🙂", "\x00\x1f", "</s>", "{\"json\": [1]}", " " * 3]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_text_deltas_equal_the_whole_chunk_encoded(kind):
    shaper = Shaper(kind, "chatcmpl-x\"y", 1_700_000_000, "model/with\"quote", lambda t: str(t))
    events = ChatEvents(shaper, include_usage=False)
    for text in TEXTS:
        whole = b"data: " + msgspec.json.encode(shaper.stream_chunk(text, None, None, False)) + b"\n\n"
        assert events.delta(text, None, False) == whole


def test_first_delta_and_logprobs_take_the_full_path():
    shaper = Shaper("chat", "chatcmpl-1", 1, "m", lambda t: f"<{t}>")
    events = ChatEvents(shaper, include_usage=False)
    first = msgspec.json.decode(events.delta("hi", None, True)[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    from workers.protocol import TokenLogprob

    lp = msgspec.json.decode(events.delta("x", [TokenLogprob(token_id=7, logprob=-0.5, top=[])], False)[6:])
    assert lp["choices"][0]["logprobs"]["content"][0]["token"] == "<7>"
