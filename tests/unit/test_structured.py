"""Structured outputs: response_format into a checked schema (400s that name the parameter), and the
engine-side grammar constraint on the bundled model's real 262,144-token vocabulary: the mask a step
applies, greedy decoding under it, draft cutting, and the per-schema compile cache."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from gateway.errors import APIError
from gateway.structured import ANY_OBJECT, MAX_SCHEMA_BYTES, response_format_grammar, schema_text
from workers.cupy.constrain import MASKED, Constraints, GrammarCompiler, GrammarError, apply_bitmask
from workers.protocol.model import load_model_info, load_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def rejects(param: str, rf) -> APIError:
    with pytest.raises(APIError) as e:
        response_format_grammar(rf)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


# ---- the gateway's checks --------------------------------------------------------------------------
def test_response_formats():
    assert response_format_grammar(None) is None and response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}) == ANY_OBJECT
    text = response_format_grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert json.loads(text) == PERSON


def test_malformed_schemas_are_400s_that_say_why():
    e = rejects("response_format.json_schema.schema",
                {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strnig"}}})
    assert "strnig" in e.message
    rejects("response_format.json_schema.schema", {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}})
    rejects("response_format.json_schema.schema", {"type": "json_schema", "json_schema": {
        "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}})
    rejects("response_format.json_schema.schema", {"type": "json_schema", "json_schema": {"schema": [1]}})
    rejects("response_format.json_schema.schema", {"type": "json_schema", "json_schema": {"name": "x"}})
    rejects("response_format.json_schema", {"type": "json_schema"})
    rejects("response_format.type", {"type": "xml"})


def test_huge_schemas_are_refused_before_compiling():
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "x" * 40}
                                              for i in range(2000)}}
    e = rejects("response_format.json_schema.schema", {"type": "json_schema", "json_schema": {"schema": huge}})
    assert e.code == "schema_too_large" and str(MAX_SCHEMA_BYTES) in e.message


@pytest.mark.parametrize("depth", [500, 5000])
def test_deeply_nested_schemas_are_400s(depth):
    schema = cur = {"type": "array"}
    for _ in range(depth):
        cur["items"] = cur = {"type": "array"}
    with pytest.raises(APIError) as e:
        schema_text(schema, "response_format.json_schema.schema")
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema"


def test_schema_checks_are_cached_per_schema(monkeypatch):
    import gateway.structured as structured

    schema_text(PERSON, "p")
    calls = []
    monkeypatch.setattr(structured, "compile_error", lambda text: calls.append(text))
    schema_text(dict(PERSON), "p")
    assert calls == []  # the verdict came from the cache (by the text's hash)


# ---- the engine side, on the real vocabulary --------------------------------------------------------
@pytest.fixture(scope="module")
def vocab():
    info, tok = load_model_info(None), load_tokenizer(None)
    compiler = GrammarCompiler(tok, info.vocab_size, info.eos_token_ids)
    assert compiler.ready(120)
    return info, tok, compiler


def allowed_ids(constraints: Constraints, rid: str, vocab_size: int) -> np.ndarray:
    logits = np.zeros((1, vocab_size), np.float32)
    constraints.apply(logits, [rid])
    return np.flatnonzero(logits[0] != MASKED)


def test_mask_allows_exactly_the_grammar_s_next_tokens(vocab):
    info, tok, compiler = vocab
    c = Constraints(compiler, np)
    c.attach("r", schema_text(PERSON, "p"))
    first = allowed_ids(c, "r", info.vocab_size)
    assert 0 < len(first) < 100 and all(tok.decode([int(t)]).startswith("{") for t in first)
    c.advance(["r"], [tok.token_to_id("{")])
    texts = {tok.decode([int(t)]) for t in allowed_ids(c, "r", info.vocab_size)}
    assert texts and all('"name"'.startswith(t) or t.startswith('"') for t in texts)


def greedy_under_grammar(compiler, schema: str, scores: np.ndarray, tok, max_steps=80) -> str:
    """Decode with a fixed preference order over the vocabulary (a stand-in for logits) under the mask."""
    c = Constraints(compiler, np)
    c.attach("g", schema)
    out: list[int] = []
    for _ in range(max_steps):
        logits = scores[None, :].copy()
        c.apply(logits, ["g"])
        token = int(np.argmax(logits[0]))
        if token in (1, 106):
            break
        c.advance(["g"], [token])
        out.append(token)
    return tok.decode(out)


def test_any_preference_order_yields_valid_json_for_the_schema(vocab):
    info, tok, compiler = vocab
    rng = np.random.default_rng(7)
    schema = schema_text(PERSON, "p")
    for _ in range(3):
        scores = rng.standard_normal(info.vocab_size).astype(np.float32)
        scores[[1, 106]] -= 2.0  # prefer to go on; the grammar still closes the object within the bounds
        text = greedy_under_grammar(compiler, schema, scores, tok)
        jsonschema.validate(json.loads(text), PERSON)


def test_batch_masks_only_constrained_rows(vocab):
    info, tok, compiler = vocab
    c = Constraints(compiler, np)
    c.attach("b", ANY_OBJECT)
    logits = np.zeros((3, info.vocab_size), np.float32)
    c.apply(logits, ["a", "b", "z"])
    assert (logits[[0, 2]] == 0).all() and (logits[1] == MASKED).sum() > info.vocab_size // 2


def test_a_refused_token_leaves_only_end_of_sequence(vocab):
    info, tok, compiler = vocab
    c = Constraints(compiler, np)
    c.attach("e", ANY_OBJECT)
    c.advance(["e"], [tok.token_to_id("hello")])  # not a JSON object's start
    assert set(allowed_ids(c, "e", info.vocab_size)) == set(info.eos_token_ids)


def test_release_frees_the_sequence(vocab):
    _, _, compiler = vocab
    c = Constraints(compiler, np)
    c.attach("x", ANY_OBJECT)
    c.release("x")
    assert "x" not in c


def test_drafts_are_cut_where_the_grammar_stops_allowing_them(vocab):
    _, tok, compiler = vocab
    c = Constraints(compiler, np)
    c.attach("d", schema_text(PERSON, "p"))
    good = tok.encode('{"name": "Al"', add_special_tokens=False).ids
    bad = tok.encode('}', add_special_tokens=False).ids + good  # closing before the required "age": refused
    assert c.cut_drafts("d", good + bad) == len(good)
    assert c.cut_drafts("d", good) == len(good)  # the matcher was left where it was
    assert c.cut_drafts("unconstrained", bad) == len(bad)


def test_verify_masks_follow_the_drafts_then_roll_back(vocab):
    info, tok, compiler = vocab
    c = Constraints(compiler, np)
    c.attach("v", schema_text(PERSON, "p"))
    drafts = tok.encode('{"name": "Al"', add_special_tokens=False).ids
    masks = c.verify_bitmasks("v", drafts + tok.encode("}", add_special_tokens=False).ids)
    assert masks.shape[0] == len(drafts) + 1
    for i, t in enumerate(drafts):  # each draft is allowed by the mask of its own position
        assert (masks[i, t // 32] >> (t % 32)) & 1
    assert (allowed_ids(c, "v", info.vocab_size) == np.flatnonzero(
        np.unpackbits(masks[0].view(np.uint8), bitorder="little")[:info.vocab_size])).all()  # rolled back


def test_verification_rows_are_masked_per_draft_position(vocab):
    info, tok, compiler = vocab
    c = Constraints(compiler, np)
    c.attach("v", schema_text(PERSON, "p"))
    draft = tok.encode('{"name"', add_special_tokens=False).ids
    ids = ["free"] * 3 + ["v"] * (len(draft) + 1)
    logits = np.zeros((len(ids), info.vocab_size), np.float32)
    c.apply_drafts(logits, ids, {"free": [5, 6], "v": draft})
    assert (logits[:3] == 0).all()  # a sequence without a grammar keeps every row open
    masks = c.verify_bitmasks("v", draft)
    for r in range(len(draft) + 1):
        want = np.unpackbits(masks[r].view(np.uint8), bitorder="little")[:info.vocab_size].astype(bool)
        assert ((logits[3 + r] == 0) == want).all()


def test_uncompilable_schema_raises_grammar_error(vocab):
    _, _, compiler = vocab
    with pytest.raises(GrammarError):
        compiler.matcher('{"type": "strnig"}')
    with pytest.raises(GrammarError):
        compiler.matcher("[]")


def test_compiled_grammars_are_cached_per_schema(vocab):
    _, _, compiler = vocab
    schema = schema_text({"type": "object", "properties": {"k": {"type": "boolean"}}}, "p")
    compiler.matcher(schema)
    base = compiler._cache[schema]
    compiler.matcher(schema)
    assert compiler._cache[schema] is base


def test_bitmask_unpacks_in_token_order():
    bitmask = np.zeros((1, 2), np.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[0, 1] = 1 << 1  # token 33
    logits = np.zeros((1, 40), np.float32)
    apply_bitmask(np, logits, [0], bitmask)
    assert list(np.flatnonzero(logits[0] == 0)) == [3, 33]


@pytest.mark.parametrize("allowed", [[0, 5, 31, 32, 262_143], list(range(0, 262_144, 3))])
def test_host_masking_of_sparse_and_dense_rows_agrees_with_the_bits(allowed):
    vocab = 262_144
    bitmask = np.zeros((2, vocab // 32), np.int32)
    for t in allowed:
        bitmask[1, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    logits = np.arange(2 * vocab, dtype=np.float32).reshape(2, vocab)
    apply_bitmask(np, logits, [1], bitmask[1:])
    assert (logits[0] == np.arange(vocab)).all()  # an unconstrained row is untouched
    kept = np.flatnonzero(logits[1] != MASKED)
    assert list(kept) == allowed and (logits[1, kept] == vocab + kept).all()


@pytest.mark.parametrize("rows", [[0, 1, 2], [1]])
def test_device_path_masks_like_the_host_path(rows):
    """The vectorised path CuPy takes, run here with NumPy's functions standing in for cupy's."""
    import types

    xp = types.SimpleNamespace(asarray=np.asarray, unpackbits=np.unpackbits, copyto=np.copyto, where=np.where)
    rng = np.random.default_rng(3)
    bitmask = rng.integers(-2**31, 2**31, size=(len(rows), 8), dtype=np.int64).astype(np.int32)
    bitmask[0, :4] = 0
    logits = rng.standard_normal((3, 250)).astype(np.float32)
    host, device = logits.copy(), logits.copy()
    apply_bitmask(np, host, rows, bitmask)
    apply_bitmask(xp, device, rows, bitmask)
    assert (host == device).all() and (host == MASKED).sum() > 0
