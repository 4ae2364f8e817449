"""bench/routing.py's pure parts: the agent trace, the oracle, and the per-request queue trace."""
from __future__ import annotations

from bench import routing
from bench.routing import TraceSpec, build_trace, oracle_hits, request_trace, run_metrics


def test_trace_is_an_agent_fleet():
    spec = TraceSpec(sessions=3, turns=4, edit_prob=1.0)
    trace = build_trace(spec, "salt 1")
    assert build_trace(spec, "salt 1") == trace and len(trace) == 3
    system = trace[0][0][1][0]
    for turns in trace:
        assert [t[1][0] for t in turns] == [system] * 4  # one shared system prompt, first in every prompt
        sizes = [sum(len(m["content"]) for m in msgs) for _, msgs in turns]
        assert sizes == sorted(sizes)  # growing contexts
        assert all("<tool_result>" in msgs[-1]["content"] for _, msgs in turns)  # each turn carries tool output
    edited = [m for turns in trace for _, msgs in turns for m in msgs if "(edited)" in m["content"]]
    assert edited  # mid-context edits happen (every turn from the 3rd with edit_prob 1)
    assert build_trace(spec, "salt 2")[0][0][1][0] != system  # a new salt: a new system prompt, a cold cache


def test_oracle_pools_every_cache_and_leaves_one_token():
    block = 4
    a = list(range(12))
    assert oracle_hits([a, a, a + [99] * 5], block, capacity_blocks=100) == [0, 8, 12]
    assert oracle_hits([a, list(range(50, 62)), a], block, capacity_blocks=3) == [0, 0, 0]  # evicted


def _rec(sent, ttft, worker, prompt, cached):
    return {"sent": sent, "ttft": ttft, "worker": worker, "ids": [0] * prompt, "cached": cached, "status": 200,
            "error": None, "prompt": prompt}


def test_request_trace_counts_the_prefill_queued_ahead():
    recs = [_rec(0.0, 2.0, "w0", 100, 0), _rec(0.5, 1.0, "w1", 80, 0), _rec(1.0, 0.5, "w0", 120, 100),
            _rec(3.0, 0.2, "w0", 50, 0)]
    tr = request_trace(recs, [0, 0, 100, 0])
    assert [t["ahead_same_worker"] for t in tr] == [0, 0, 1, 0]
    assert tr[2]["ahead_uncached_same_worker"] == 100 and tr[2]["ahead_any_worker"] == 2
    m = run_metrics(recs, 4.0, ["w0", "w1"], [0, 0, 100, 40], (None, None))
    assert m["uncached_per_req"] == (100 + 80 + 20 + 50) / 4
    assert m["oracle_uncached_per_req"] == (100 + 80 + 20 + 10) / 4
    assert m["load_max_over_mean"] == 1.5 and m["rejections"] == 0


def test_the_verdict_names_the_best_baseline_paired_per_repeat():
    def rec(repeat, config, p50, p99=100.0, hits=0.9, load=1.0):
        return {"phase": "measure", "repeat": repeat, "config": config,
                "metrics": {"ttft_p50_ms": p50, "ttft_p99_ms": p99, "hit_vs_oracle": hits, "load_max_over_mean": load}}

    records = [rec(0, "pulse", 50, load=1.0), rec(0, "round_robin", 150), rec(0, "session_sticky", 55, load=2.0),
               rec(1, "pulse", 100, load=1.0), rec(1, "round_robin", 300), rec(1, "session_sticky", 100, load=2.0)]
    [line] = routing.best_baseline(records)
    assert line.startswith("BEST BASELINE session_sticky: its TTFT p50 / pulse's, paired per repeat, median 1.05 "
                           "(1.00-1.10)")
    assert "load_max_over_mean 1.00 vs 2.00" in line


def test_a_trace_without_session_ids_sends_none():
    args = routing._parse(["--no-session-ids"])
    assert args.trace.session_ids is False
    assert routing._parse([]).trace.session_ids is True
