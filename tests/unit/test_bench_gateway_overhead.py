"""Gateway-overhead arithmetic: pairing per repeat, added TTFT, req/s against the relay, the goal verdict."""
import pytest

from bench import protocol
from bench.gateway_overhead import derive, verdict


def _rec(repeat, config, p50, p99, req_s, phase="measure"):
    return {"phase": phase, "repeat": repeat, "config": config,
            "metrics": {"ttft_p50_ms": p50, "ttft_p99_ms": p99, "req_s": req_s}}


def test_derive_pairs_each_target_with_direct_and_relay_of_the_same_repeat():
    records = [_rec(0, "direct@1", 1.0, 3.0, 900), _rec(0, "relay@1", 1.5, 4.0, 600), _rec(0, "pulse@1", 2.5, 9.0, 300),
               _rec(1, "direct@1", 2.0, 5.0, 800), _rec(1, "relay@1", 2.2, 6.0, 500), _rec(1, "pulse@1", 5.0, 20.0, 400),
               _rec(0, "pulse@1", 100.0, 100.0, 1, phase="warmup")]
    derived = {(d["repeat"], d["config"]): d["metrics"] for d in derive(records, ["direct", "relay", "pulse"], [1])}
    assert set(derived) == {(0, "relay@1"), (0, "pulse@1"), (1, "relay@1"), (1, "pulse@1")}
    assert derived[(0, "pulse@1")] == pytest.approx(
        {"added_ttft_p50_ms": 1.5, "added_ttft_p99_ms": 6.0, "over_relay_ttft_p50_ms": 1.0, "req_s_vs_relay": 0.5})
    assert derived[(1, "relay@1")] == pytest.approx({"added_ttft_p50_ms": 0.2, "added_ttft_p99_ms": 1.0})
    assert derived[(1, "pulse@1")]["req_s_vs_relay"] == pytest.approx(0.8)


def test_verdict_judges_medians_against_the_goal():
    records = []
    for r in range(5):
        records += [_rec(r, "direct@1", 1.0, 3.0, 900), _rec(r, "relay@1", 1.2, 4.0, 600),
                    _rec(r, "pulse@1", 2.0 + r * 0.1, 30.0, 400),
                    _rec(r, "direct@32", 20.0, 40.0, 1000), _rec(r, "relay@32", 24.0, 60.0, 800),
                    _rec(r, "pulse@32", 50.0, 200.0, 100)]
    summary = protocol.summarize(derive(records, ["direct", "relay", "pulse"], [1, 32]))
    lines = verdict(summary, [1, 32])
    assert len(lines) == 6
    # 1 client: added p50 = 1.0..1.4 (median 1.2) meets <= 2; p99 27 misses; 400/600 misses >= 0.8
    assert lines[0].startswith("MET  1 clients: added_ttft_p50_ms median 1.20")
    assert lines[1].startswith("MISS 1 clients: added_ttft_p99_ms")
    assert lines[2].startswith("MISS 1 clients: req_s_vs_relay median 0.67")
    assert all(line.startswith("MISS 32 clients") for line in lines[3:])


def test_verdict_is_empty_without_pulse():
    assert verdict({"relay@1": {"added_ttft_p50_ms": protocol.spread([1.0])}}, [1]) == []


def test_cpu_against_the_relay_and_the_held_open_goals():
    records = []
    for r in range(5):
        for c, relay_cpu, pulse_cpu, pulse_p99 in ((32, 1.0, 1.1, 30.0), (1000, 1.0, 3.0, 60.0)):
            records += [_rec(r, f"direct@{c}", 10.0, 20.0, 900), _rec(r, f"relay@{c}", 11.0, 25.0, 800),
                        _rec(r, f"pulse@{c}", 12.0, pulse_p99, 800)]
            records[-2]["metrics"]["path_cpu_ms_per_req"] = relay_cpu
            records[-1]["metrics"]["path_cpu_ms_per_req"] = pulse_cpu
            records[-1]["metrics"]["errors"] = 0
    summary = protocol.summarize(records + derive(records, ["direct", "relay", "pulse"], [32, 1000]))
    assert summary["pulse@32"]["cpu_vs_relay"]["median"] == pytest.approx(1.1)
    lines = verdict(summary, [32, 1000])
    assert "MET  32 clients: cpu_vs_relay median 1.10 (goal <= 1.2)" in lines
    # held-open streams: only the looser p99 (40 ms over direct misses 25) and no errors are judged
    assert lines[-2:] == ["MISS 1000 clients: added_ttft_p99_ms median 40.00 (goal <= 25)",
                          "MET  1000 clients: errors median 0.00 (goal <= 0)"]


def test_a_second_pulse_is_paired_with_the_first_in_each_repeat():
    records = []
    for r, (a_cpu, b_cpu) in enumerate(((1.0, 2.0), (1.5, 2.0), (0.9, 1.0))):
        records += [_rec(r, "direct@32", 10.0, 20.0, 900), _rec(r, "relay@32", 11.0, 25.0, 800),
                    _rec(r, "pulse@32", 12.0, 30.0, 600), _rec(r, "pulse_b@32", 14.0, 40.0, 400)]
        records[-2]["metrics"]["gateway_cpu_ms_per_req"] = a_cpu
        records[-1]["metrics"]["gateway_cpu_ms_per_req"] = b_cpu
    derived = {(d["repeat"], d["config"]): d["metrics"] for d in derive(records, ["direct", "relay", "pulse", "pulse_b"], [32])}
    assert derived[(0, "pulse@32")]["gateway_cpu_ms_per_req_vs_b"] == pytest.approx(0.5)
    assert derived[(1, "pulse@32")]["req_s_vs_b"] == pytest.approx(1.5)
    assert derived[(2, "pulse_b@32")]["req_s_vs_relay"] == pytest.approx(0.5)  # the second one against the relay too
    assert "gateway_cpu_ms_per_req_vs_b" not in derived[(2, "pulse_b@32")]
    summary = protocol.summarize(derive(records, ["direct", "relay", "pulse", "pulse_b"], [32]))
    assert summary["pulse@32"]["gateway_cpu_ms_per_req_vs_b"]["median"] == pytest.approx(0.75)
