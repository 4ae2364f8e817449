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


def _deltas(frames: list[bytes]) -> list[dict]:
    return [msgspec.json.decode(e[6:])["choices"][0] for f in frames for e in f.split(b"\n\n") if e]


def test_chunks_that_came_together_make_one_delta_unless_first_or_with_logprobs():
    from gateway.completions import _batch_events
    from workers.protocol import Chunk, TokenLogprob

    shaper = Shaper("chat", "chatcmpl-1", 1, "m", lambda t: f"<{t}>")
    events = ChatEvents(shaper, include_usage=False)
    lp = [TokenLogprob(token_id=9, logprob=-0.1, top=[])]
    batch = [Chunk(text="He", token_ids=[1]), Chunk(text="llo", token_ids=[2]), Chunk(text=",", token_ids=[3]),
             Chunk(text=" w", token_ids=[4], logprobs=lp), Chunk(text="or", token_ids=[5]),
             Chunk(text="", token_ids=[]), Chunk(text="ld", token_ids=[6])]
    frames, first, final = _batch_events(events, batch, True)
    got = [(d["delta"].get("content"), bool(d.get("logprobs"))) for d in _deltas(frames)]
    assert got == [("He", False), ("llo,", False), (" w", True), ("orld", False)] and not first and final is None
    # a later batch: no role, the finish ends it (its text sent first); an error's text is not sent
    end = Chunk(text="!", token_ids=[8], finish_reason="stop")
    frames, first, final = _batch_events(events, [Chunk(text="a", token_ids=[7]), end, Chunk(text="x")], False)
    assert [d["delta"] for d in _deltas(frames)] == [{"content": "a!"}] and final is end
    err = Chunk(text="lost", finish_reason="error", error="boom")
    frames, _, final = _batch_events(events, [Chunk(text="b", token_ids=[9]), err], False)
    assert [d["delta"] for d in _deltas(frames)] == [{"content": "b"}] and final is err
    assert _batch_events(events, [], False) == ([], False, None)
