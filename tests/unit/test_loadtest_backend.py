"""The load-test backend's pacing: the first token at once (or after `ttft_s`), the rest at `tokens_per_s`, as the
bench's upstream paces its stream (bench/relay.py), so a held stream's "added TTFT" in bench/gateway_overhead.py
is the gateway's alone."""
from __future__ import annotations

import time

import pytest

from policy.config import PulseConfig
from workers.loadtest import LoadTestBackend
from workers.protocol import GenerateRequest


async def _times(ttft_s: float) -> tuple[float, float, int]:
    config = PulseConfig.model_validate({"workers": {"backend": "loadtest", "loadtest": {
        "tokens": 3, "tokens_per_s": 10, "ttft_s": ttft_s}}})
    backend = LoadTestBackend(config, worker_id="w0")
    t0, first, n = time.perf_counter(), None, 0
    async for chunk in backend.generate(GenerateRequest(request_id="r", prompt_ids=[1, 2], max_tokens=3)):
        if chunk.token_ids:
            first = first if first is not None else time.perf_counter() - t0
            n += len(chunk.token_ids)
    return first, time.perf_counter() - t0, n


@pytest.mark.parametrize("ttft_s", [0.0, 0.3])
async def test_first_token_after_ttft_then_the_rate(ttft_s):
    first, total, n = await _times(ttft_s)
    assert n == 3
    assert ttft_s <= first < ttft_s + 0.08  # not one gap (0.1 s) late
    assert ttft_s + 0.2 <= total < ttft_s + 0.35  # two gaps after the first token
