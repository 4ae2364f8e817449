"""llama-server overhead bench: the added-TTFT arithmetic and verdict, the direct request body, and the
loadgen pieces it uses for llama-server's native /completion."""
import pytest

from bench.llama_server_overhead import config_yaml, direct_body, summarize, verdict
from bench.loadgen import LoadSpec, event_content, request_body


def _rec(repeat, config, p50, p99, phase="measure"):
    return {"phase": phase, "repeat": repeat, "config": config,
            "metrics": {"ttft_p50_ms": p50, "ttft_p99_ms": p99, "req_s": 1.0}}


def test_added_ttft_is_paired_within_each_repeat_and_judged_on_the_median():
    records = [_rec(0, "pulse@1", 500.0, 500.0, phase="warmup"), _rec(0, "direct@1", 1.0, 1.0, phase="warmup")]
    for r, (d, p) in enumerate([(10.0, 11.0), (20.0, 23.5), (15.0, 16.0), (30.0, 30.5), (12.0, 14.0)]):
        records += [_rec(r, "direct@1", d, d * 2), _rec(r, "pulse@1", p, p * 2 + 1),
                    _rec(r, "direct@32", 100.0, 300.0), _rec(r, "pulse@32", 103.0 + r, 310.0)]
    summary = summarize(records, [1, 32])
    assert list(summary) == ["direct@1", "pulse@1", "direct@32", "pulse@32"]
    added = summary["pulse@1"]["added_ttft_p50_ms"]
    # differences 1.0, 3.5, 1.0, 0.5, 2.0: the warm-up pair (499 ms) is not among them
    assert (added["median"], added["min"], added["max"], added["n"]) == (1.0, 0.5, 3.5, 5)
    assert summary["pulse@1"]["added_ttft_p99_ms"]["median"] == pytest.approx(3.0)
    assert summary["pulse@32"]["added_ttft_p50_ms"]["median"] == 5.0
    assert "added_ttft_p50_ms" not in summary["direct@1"]
    lines = verdict(summary, [1, 32])
    assert lines[0].startswith("MET  1 clients: added_ttft_p50_ms median 1.00 (min 0.50, max 3.50")
    assert lines[1].startswith("MISS 32 clients: added_ttft_p50_ms median 5.00")


def test_verdict_says_when_a_client_count_has_no_pairs():
    assert verdict({}, [32]) == ["NONE 32 clients: no added_ttft_p50_ms (a target served nothing)"]


def test_direct_body_is_what_the_backend_sends_for_a_greedy_request():
    body = direct_body([2, 10, 11], 4)
    assert body["prompt"] == [2, 10, 11] and body["n_predict"] == 4 and body["stream"] is True
    assert body["id_slot"] == -1 and body["cache_prompt"] is True
    assert (body["temperature"], body["top_k"], body["min_p"]) == (0.0, 1, 0.0)  # greedy: one candidate
    # and the llama api sends it as given
    path, sent = request_body(LoadSpec(url="x", api="llama", prompt=[2, 10, 11], max_tokens=4, body_extra=body))
    assert path == "/completion" and sent == body


def test_config_is_one_llama_server_worker():
    import json
    from pathlib import Path

    class A:
        slots, kv_tokens, threads, binary = 32, 8192, None, None

    cfg = json.loads(config_yaml(A, Path("/tmp/x")))
    assert cfg["workers"] == {"backend": "llama-server", "count": 1,
                              "llama_server": {"slots": 32, "kv_tokens": 8192, "log_dir": "/tmp/x"}}


def test_llama_events_carry_content_and_the_final_one_predicted_n():
    assert event_content({"content": "Hi", "stop": False}) == ("Hi", None)
    assert event_content({"content": "", "stop": True, "timings": {"predicted_n": 7}}) == ("", 7)
    assert event_content({"content": "x", "stop": False, "timings": {"predicted_n": 3}}) == ("x", None)


def test_token_id_prompts_go_to_completions_but_not_chat():
    _, body = request_body(LoadSpec(url="x", api="completions", prompt=[1, 2, 3], body_extra={"top_k": 1}))
    assert body["prompt"] == [1, 2, 3] and body["top_k"] == 1
    with pytest.raises(ValueError):
        request_body(LoadSpec(url="x", api="chat", prompt=[1, 2, 3]))
