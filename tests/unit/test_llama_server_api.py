"""The /completion body Pulse sends llama-server: sampling settings mapped to llama.cpp's cheapest exact path."""
from __future__ import annotations

import msgspec
import pytest

from workers.llama_server.api import request_body, sampler_settings
from workers.protocol import BackendError, GenerateRequest, SamplingParams


def body(sampling: SamplingParams, **kw) -> dict:
    req = GenerateRequest(request_id="r", prompt_ids=[2, 10, 11], max_tokens=8, sampling=sampling, **kw)
    return msgspec.json.decode(request_body(req, None))


@pytest.mark.parametrize("temperature", [0.0, -1.0, 1e-30])
def test_greedy_is_top_k_1(temperature):
    # top_k 1 leaves one candidate for the softmax; temperature 0 with top_k 0 runs it over the whole vocabulary
    s = SamplingParams(temperature=temperature, top_p=0.5, top_k=40, min_p=0.2, seed=7)
    assert sampler_settings(s) == {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}


@pytest.mark.parametrize("s, expected", [
    # OpenAI's defaults: the full distribution (llama-server's own top_k 40 / top_p 0.95 / min_p 0.05 would cut it)
    (SamplingParams(), {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
    (SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05),
     {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05}),
    (SamplingParams(temperature=0.5, top_k=-3), {"temperature": 0.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
    # top_k 1 is the argmax at any temperature: sent as greedy, as the engine treats it
    (SamplingParams(temperature=1.0, top_k=1), {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}),
])
def test_sampled_settings_keep_the_distribution(s, expected):
    assert sampler_settings(s) == expected


def test_a_seeded_request_skips_the_prompt_cache_on_a_gpu_server_only():
    req = GenerateRequest(request_id="r", prompt_ids=[2, 10, 11], max_tokens=8,
                          sampling=SamplingParams(temperature=1.0, seed=5))
    assert msgspec.json.decode(request_body(req, 0, exact_seed=True))["cache_prompt"] is False
    assert msgspec.json.decode(request_body(req, 0))["cache_prompt"] is True  # CPU: the cached repeat is exact
    plain = GenerateRequest(request_id="r", prompt_ids=[2, 10, 11], max_tokens=8, sampling=SamplingParams())
    assert msgspec.json.decode(request_body(plain, 0, exact_seed=True))["cache_prompt"] is True


def test_body_always_carries_every_sampler_field_and_the_seed():
    b = body(SamplingParams(temperature=0.0, seed=3))
    assert (b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seed"]) == (0.0, 1, 1.0, 0.0, 3)
    assert b["backend_sampling"] is False  # a seeded request draws on the host, where the seed repeats
    b = body(SamplingParams())
    assert b["min_p"] == 0.0 and b["top_k"] == 0 and "seed" not in b  # llama-server's min_p default is 0.05
    assert b["prompt"] == [2, 10, 11] and b["n_predict"] == 8 and b["stream"] and b["cache_prompt"]


def test_logprobs_and_grammar_ride_along_with_greedy():
    b = body(SamplingParams(temperature=0.0), logprobs=0, grammar='{"type": "object"}')
    assert b["top_k"] == 1 and b["n_probs"] == 1 and b["json_schema"] == {"type": "object"}
    with pytest.raises(BackendError) as e:
        body(SamplingParams(temperature=0.0), grammar="not json")
    assert e.value.status == 400
