"""bench/llama_cpu.py's reading of llama-server's timings and of the batch-8 stream (pure: no server)."""
import pytest

from bench.llama_cpu import Stream, checked_timings, completion_body, decode_rates

# The final event's timings as this llama-server build sends them (captured from the CPU build).
REAL = {"cache_n": 0, "prompt_n": 16, "prompt_ms": 40.0, "prompt_per_token_ms": 2.5, "prompt_per_second": 400.0,
        "predicted_n": 64, "predicted_ms": 1260.0, "predicted_per_token_ms": 20.0, "predicted_per_second": 50.0}


def test_full_prefill_and_every_token_pass():
    assert checked_timings(REAL, 16, 64) is REAL


@pytest.mark.parametrize("change", [{"cache_n": 4}, {"prompt_n": 12}, {"predicted_n": 63}])
def test_a_cached_prefix_or_a_short_run_is_refused(change):
    with pytest.raises(ValueError):
        checked_timings({**REAL, **change}, 16, 64)


def test_missing_timings_are_refused():
    with pytest.raises(ValueError, match="no timings"):
        checked_timings(None, 16, 64)


def test_requests_are_greedy_and_never_reuse_the_prompt_cache():
    body = completion_body([2, 5, 7], 8)
    assert body["cache_prompt"] is False and body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["ignore_eos"] is True and body["n_predict"] == 8 and body["prompt"] == [2, 5, 7]


def test_batch_rates_count_only_tokens_after_the_last_first_token():
    # two streams; the second's first token comes at t=1.0: tokens at or before it are prefill-phase
    a = Stream(arrivals=[(0.5, 1), (1.0, 1), (1.5, 1), (2.0, 1)])
    b = Stream(arrivals=[(1.0, 1), (1.5, 1), (3.0, 1)])
    rates = decode_rates([a, b], t0=1.0, end=3.0, cpu_s=0.5)
    assert rates == {"wall": 4 / 2.0, "cpu": 4 / 0.5}
