"""The real-backend soak's requests (bench/reliability.py): what a fleet of OpenAI clients sends, every prompt new."""
from __future__ import annotations

import json

from bench.reliability import BASE_MODEL, CHAT_MODEL, REAL_KINDS, Soak, real_request, server_config


def test_real_requests_rotate_kinds_models_and_send_no_sampling_settings():
    reqs = [real_request(i, 32) for i in range(400)]
    prompts = [json.dumps(b.get("messages") or b.get("prompt")) for _, b in reqs]
    assert len(set(prompts)) == len(prompts)  # no request rides another's cached prompt whole
    assert {b["model"] for _, b in reqs} == {BASE_MODEL, CHAT_MODEL}
    assert {p for p, _ in reqs} == {"/v1/chat/completions", "/v1/completions", "/v1/messages"}
    assert sum("response_format" in b for _, b in reqs) == 400 // len(REAL_KINDS)  # the JSON-schema chats
    for path, b in reqs:
        assert b["stream"] and b["max_tokens"] == 32
        assert path == "/v1/messages" or b["stream_options"] == {"include_usage": True}  # OpenAI's usage chunk
        assert not {"temperature", "top_k", "top_p", "seed", "ignore_eos"} & set(b)  # the SDKs' defaults


def test_real_soak_serves_as_shipped():
    text = server_config(Soak(backend="llama-server"))
    assert "backend: llama-server" in text and "model" not in text and "slots" not in text
    assert "backend: loadtest" in server_config(Soak())
