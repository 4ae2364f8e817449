"""Load generator pieces that need no server: target check, request bodies, event parsing, aggregation."""
import pytest

from bench.loadgen import LoadSpec, RequestResult, aggregate, check_target, event_content, percentiles, request_body


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:80", "http://127.5.5.5"])
def test_loopback_targets_are_allowed(url):
    check_target(url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://8.8.8.8", "http://[2001:db8::1]:80", "nohost"])
def test_other_targets_are_refused_without_allow_remote(url):
    with pytest.raises(ValueError):
        check_target(url)


def test_allow_remote_lets_a_remote_literal_through():
    check_target("http://10.0.0.1:8000", allow_remote=True)


def test_request_bodies():
    path, body = request_body(LoadSpec(url="x", api="chat", max_tokens=7))
    assert path == "/v1/chat/completions" and body["messages"][0]["role"] == "user"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 7
    path, body = request_body(LoadSpec(url="x", api="completions", stream=False))
    assert path == "/v1/completions" and "prompt" in body and "stream_options" not in body
    with pytest.raises(ValueError):
        request_body(LoadSpec(url="x", api="embeddings"))


def test_event_content_reads_chat_and_completion_events():
    assert event_content({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ("", None)
    assert event_content({"choices": [{"delta": {"content": "hi"}}]}) == ("hi", None)
    assert event_content({"choices": [{"text": "yo", "index": 0}]}) == ("yo", None)
    assert event_content({"choices": [], "usage": {"completion_tokens": 16}}) == ("", 16)


def test_percentiles_in_ms():
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_aggregate_counts_429_apart_from_errors_and_rates_only_served_requests():
    results = [RequestResult(200, ttft=0.001 * i, itl=[0.0001], total=0.002 * i, tokens=16) for i in range(1, 11)]
    full = "Workers are at capacity and the queue is full (N waiting); retry after N s."
    results += [RequestResult(429, reason=full), RequestResult(429, reason=full), RequestResult(500),
                RequestResult(0, error="ClientOSError"), RequestResult(200, error="stream_error", tokens=3)]
    out = aggregate(results, wall=2.0)
    m = out["metrics"]
    assert (m["requests"], m["ok"], m["rate_limited"], m["errors"]) == (15, 10, 2, 3)
    assert m["req_s"] == 5.0 and m["tok_s"] == 80.0 and m["events_per_req"] == 2.0  # the first event, one gap
    assert m["ttft_p50_ms"] == pytest.approx(5.5) and m["itl_p50_ms"] == pytest.approx(0.1)
    assert out["status_counts"] == {"200": 11, "429": 2, "500": 1, "none": 1}
    assert out["error_kinds"] == {"500": 1, "ClientOSError": 1, "stream_error": 1}
    assert out["refusals"] == {f"429: {full}": 2}


def test_refusal_reason_reads_openai_and_anthropic_errors_with_numbers_folded():
    from bench.loadgen import refusal_reason

    assert refusal_reason(b'{"error": {"message": "the queue is full (312 waiting); retry after 2 s.", '
                          b'"type": "server_overloaded"}}') == "the queue is full (N waiting); retry after N s."
    assert refusal_reason(b'{"type": "error", "error": {"type": "overloaded_error", "message": "waited 30.5 s"}}'
                          ) == "waited N s"
    assert refusal_reason(b'{"detail": "Not Found"}') == "Not Found"
    assert refusal_reason(b"<html>bad gateway</html>") is None
    assert refusal_reason(b'{"error": "plain"}') is None


def _held_requests(monkeypatch, hold_s: float) -> list[float]:
    """Replace loadgen's HTTP call by one that holds each request `hold_s` and answers 200; returns the list the
    send times land in."""
    import asyncio
    import time

    from bench import loadgen

    sends: list[float] = []

    async def held(session, url, body, stream):
        sends.append(time.perf_counter())
        await asyncio.sleep(hold_s)
        return RequestResult(status=200, ttft=0.01, total=hold_s, tokens=1)

    monkeypatch.setattr(loadgen, "one_request", held)
    return sends


@pytest.mark.parametrize("stagger", [0.0, 0.4])
async def test_closed_loop_clients_start_spread_over_the_stagger(monkeypatch, stagger):
    """stagger_s spreads the clients' first requests (client i at i x S / C); the HTTP call is replaced by one that
    holds each request 0.6 s (longer than the stagger), so the four requests are the four clients' first ones."""
    import time

    from bench import loadgen

    starts = _held_requests(monkeypatch, 0.6)
    spec = LoadSpec(url="http://127.0.0.1:1", clients=4, requests=4, duration=10, stagger_s=stagger)
    t0, results = time.perf_counter(), []
    await loadgen._closed_loop(spec, None, "u", {}, t0, results)
    assert len(results) == 4 and min(starts) - t0 < 1.0
    # spacing from the first client's start: the loop's first turn (its setup) may take a while on a busy box,
    # which is not what the stagger spreads (the first start came over 0.05 s after t0 once in a full unit run on
    # the 2-core box)
    offsets = sorted(s - min(starts) for s in starts)
    for i, at in enumerate(offsets):
        assert at == pytest.approx(i * stagger / 4, abs=0.05)


async def test_closed_loop_clients_think_between_requests(monkeypatch):
    """think_s: after each answer a client waits a draw from [0, 2 x think_s) before its next request (its own seeded
    draws), and not after its last; with no think time the next request follows the answer at once."""
    import random
    import time

    from bench import loadgen

    sends = _held_requests(monkeypatch, 0.01)
    for think in (0.0, 0.1):
        sends.clear()
        spec = LoadSpec(url="http://127.0.0.1:1", clients=1, requests=4, duration=10, think_s=think)
        t0, results = time.perf_counter(), []
        await loadgen._closed_loop(spec, None, "u", {}, t0, results)
        finished = time.perf_counter()
        gaps = [b - a - 0.01 for a, b in zip(sends, sends[1:])]
        assert len(results) == 4 and len(gaps) == 3
        if think == 0:
            assert max(gaps) < 0.05
        else:
            draws = random.Random(0)
            expected = [draws.uniform(0.0, 0.2) for _ in gaps]
            for gap, want in zip(gaps, expected):
                assert gap == pytest.approx(want, abs=0.04)
            assert finished - sends[-1] < 0.05  # no wait after the last request
