"""Stop strings, incremental detokenization, and the Gemma turn format, with the model's real tokenizer."""
from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.openai_types import ChatRequest, decode, validate_chat
from gateway.prompt import PromptBuilder
from workers.protocol.detok import IncrementalDetokenizer, StopMatcher, TokenTexts
from workers.protocol.model import load_model_info, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def builder(tok):
    info = load_model_info()
    return PromptBuilder(tok, architecture=info.architecture, bos_token_id=info.bos_token_id, add_bos=info.add_bos,
                         template=info.chat_template)


def feed(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.push(p) for p in pieces) + matcher.flush()


@pytest.mark.parametrize("pieces,stops,want", [
    (["Hello", " wor", "ld"], ["world"], "Hello "),
    (["a", "b", "c"], [], "abc"),
    (["ab", "c<", "/s", "top> tail"], ["</stop>"], "abc"),
    (["ab", "c<", "x"], ["</stop>"], "abc<x"),
    (["one END two"], ["END", "one"], ""),
    (["xx", "E", "N"], ["END"], "xxEN"),
])
def test_stop_matcher(pieces, stops, want):
    m = StopMatcher(stops)
    assert feed(m, pieces) == want


def test_incremental_detok_matches_whole_decode(tok):
    text = "def héllo():\n    return '日本語 ✓ emoji 🎉'\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok)
    out = "".join(d.push([i]) for i in ids)
    assert out == tok.decode(ids)


def test_gemma_turn_format(builder, tok):
    req = decode(b'{"model":"m","messages":[{"role":"system","content":"Be brief."},'
                 b'{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},'
                 b'{"role":"user","content":"Bye"}]}', ChatRequest)
    p = builder.chat(req.messages)
    assert p.text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                      "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert p.ids[0] == 2  # BOS
    # the turn markers are single control tokens, not spelled out
    assert tok.token_to_id("<start_of_turn>") in p.ids and tok.token_to_id("<end_of_turn>") in p.ids


def test_validation_names_parameters():
    req = decode(b'{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":0}', ChatRequest)
    with pytest.raises(APIError) as e:
        validate_chat(req, max_messages=10, max_stop_strings=4, max_stop_length=10)
    assert e.value.param == "top_p" and e.value.status == 400


@pytest.mark.parametrize("model", ["gemma-3-270m", "smollm2-135m-instruct"])
def test_known_token_texts_give_what_decoding_gives(model):
    """The detokenizer with TokenTexts (no decode for known tokens) against the one without, delta by delta
    and window by window, on token streams mixing text, byte tokens, split characters and special tokens."""
    import random

    tok = load_tokenizer(model)
    texts = TokenTexts(tok)
    assert texts.concatenative  # Gemma: Replace + ByteFallback + Fuse; SmolLM2: ByteLevel
    words = tok.encode("The keeper’s café — 日本語 ✓ 🎉 naïve\n\tdef f(x):\n    return x", add_special_tokens=False).ids
    special = [i for i in range(16) if tok.decode([i], skip_special_tokens=True) == ""]
    raw = [i for i in (tok.token_to_id(f"<0x{b:02X}>") for b in (0xE2, 0x9C, 0x93, 0xF0, 0x9F, 0x41)) if i is not None]
    rng = random.Random(7)
    for trial in range(300):
        pool = words + special + raw + [rng.randrange(tok.get_vocab_size()) for _ in range(8)]
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        tail = [rng.choice(pool) for _ in range(rng.randrange(0, 6))]
        plain, fast = IncrementalDetokenizer(tok, tail), IncrementalDetokenizer(tok, tail, texts)
        i = 0
        while i < len(ids):
            n = rng.choice([1, 1, 1, 2, 3])
            step = ids[i:i + n]
            i += n
            assert fast.push(step) == plain.push(step), (trial, ids, tail)
            assert (fast._prefix_offset, fast._read_offset) == (plain._prefix_offset, plain._read_offset)
    assert any(texts.get(t) is None for t in raw + special) and all(texts.get(t) is not None for t in words[:3])


class _ReferenceStopMatcher:
    """The matcher as first written (every tail length tried), to check the faster one against."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending, self.stopped = "", False

    def push(self, text):
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = next((n for n in range(min(self.hold, len(self.pending)), 0, -1)
                     if any(s.startswith(self.pending[-n:]) for s in self.stops)), 0)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out


def test_stop_matcher_gives_what_trying_every_tail_gives():
    import random

    rng = random.Random(3)
    alphabet = "ab</>x \n"
    for trial in range(2000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(0, 4))]
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 5))) for _ in range(rng.randrange(1, 12))]
        fast, ref = StopMatcher(stops), _ReferenceStopMatcher(stops)
        for piece in pieces:
            assert fast.push(piece) == ref.push(piece), (trial, stops, pieces)
            assert fast.stopped == ref.stopped
        assert fast.flush() == ("" if ref.stopped else ref.pending)
