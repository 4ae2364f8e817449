"""Routing strategies on the agent-fleet model (tests/unit/routing_sim.py): the policy has the intended shape.

Not a benchmark (bench/ measures real workers); a guard that a change to the scoring does not lose
the prefix hits, the balance, or the time-to-first-token advantage that the design is for.
"""
from __future__ import annotations

import statistics

import pytest

from tests.unit.routing_sim import SimConfig, simulate

SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def results():
    return {s: [simulate(s, SimConfig(seed=seed)) for seed in SEEDS]
            for s in ("round_robin", "least_loaded", "session_sticky", "pulse")}


def mean(rs, attr):
    return statistics.mean(getattr(r, attr) for r in rs)


def test_pulse_hits_close_to_an_oracle(results):
    assert mean(results["pulse"], "hit_vs_oracle") >= 0.85
    assert mean(results["pulse"], "hit_vs_oracle") > mean(results["round_robin"], "hit_vs_oracle") + 0.15


def test_pulse_keeps_load_balanced_where_sticky_does_not(results):
    assert max(r.load_ratio for r in results["pulse"]) <= 1.5
    assert max(r.load_ratio for r in results["session_sticky"]) > 1.5  # the hot-spot the guards prevent


def test_pulse_first_token_beats_the_baselines(results):
    pulse = mean(results["pulse"], "ttft_p50")
    assert pulse < 0.7 * mean(results["round_robin"], "ttft_p50")
    assert pulse < 0.7 * mean(results["least_loaded"], "ttft_p50")
    assert pulse <= mean(results["session_sticky"], "ttft_p50")
