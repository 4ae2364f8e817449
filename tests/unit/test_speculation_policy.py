"""policy.speculation.choose_k on the GB10 and Thor tables (DEVICE_FACTS.md), cell by cell."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.profiles import DeviceProfile, SpeculationRule, builtin_profiles
from policy.speculation import SCHEMA, TEXT, choose_k

GB10 = builtin_profiles()["gb10"]
THOR = builtin_profiles()["thor"]

# DEVICE_FACTS.md, one stream: best K by prompt tokens (< 8,192: 4; 8,192-10,239: 3; 10,240-14,335: 2;
# >= 14,336: 0). Each band is checked at both of its edges and inside.
ONE_STREAM = [
    (0, 4), (1, 4), (2048, 4), (8191, 4),
    (8192, 3), (9000, 3), (10239, 3),
    (10240, 2), (12000, 2), (14335, 2),
    (14336, 0), (16384, 0), (34000, 0), (131072, 0),
]


@pytest.mark.parametrize("context, k", ONE_STREAM)
def test_gb10_one_stream_follows_the_context_table(context, k):
    assert choose_k(context, 1, TEXT, GB10) == k


@pytest.mark.parametrize("context, k", [(0, 3), (8191, 3), (8192, 3), (10239, 3), (10240, 2), (14336, 0)])
def test_gb10_schema_workload_peaks_at_3(context, k):
    # schema-like prompts peaked at K = 3 at short context; above 8k the table's K is already <= 3
    assert choose_k(context, 1, SCHEMA, GB10) == k


# Four streams: speculation won at 2k (84.5 vs 64.7 tok/s) and lost from ~4-8k up (at 16k: 31.3 vs 46.9).
@pytest.mark.parametrize("concurrency", [2, 3, 4])
@pytest.mark.parametrize("context, text_k, schema_k", [(512, 4, 3), (2048, 4, 3), (4095, 4, 3), (4096, 0, 0),
                                                       (8192, 0, 0), (16384, 0, 0)])
def test_gb10_up_to_four_streams_stops_speculating_from_4k(concurrency, context, text_k, schema_k):
    assert choose_k(context, concurrency, TEXT, GB10) == text_k
    assert choose_k(context, concurrency, SCHEMA, GB10) == schema_k


@pytest.mark.parametrize("concurrency", [5, 8, 11])
@pytest.mark.parametrize("context, k", [(0, 2), (2047, 2), (2048, 0), (4096, 0)])
def test_gb10_five_to_eleven_streams_only_short_context_speculates(concurrency, context, k):
    assert choose_k(context, concurrency, TEXT, GB10) == k
    assert choose_k(context, concurrency, SCHEMA, GB10) == k


@pytest.mark.parametrize("concurrency", [12, 13, 16, 64, 1000])
@pytest.mark.parametrize("context", [0, 100, 2047, 8191, 20000])
def test_gb10_twelve_or_more_streams_never_speculate(concurrency, context):
    # "With >= 12 concurrent clients no drafter wins at any context."
    assert choose_k(context, concurrency, TEXT, GB10) == 0
    assert choose_k(context, concurrency, SCHEMA, GB10) == 0


def test_gb10_concurrency_cutoff_is_exact():
    ks = [choose_k(1000, c, TEXT, GB10) for c in range(1, 14)]
    assert ks == [4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 0, 0]


def test_thor_width_five_alone_and_less_under_load():
    assert [choose_k(c, 1, TEXT, THOR) for c in (10, 16384, 60000)] == [5, 5, 5]
    assert choose_k(1000, 2, TEXT, THOR) == 3
    assert choose_k(16384, 2, TEXT, THOR) == 0
    assert choose_k(1000, 5, TEXT, THOR) == 0


@pytest.mark.parametrize("cap, k", [(None, 4), (64, 4), (5, 4), (4, 4), (3, 3), (1, 1), (0, 0), (-1, 0)])
def test_request_cap_lowers_but_never_raises(cap, k):
    assert choose_k(100, 1, TEXT, GB10, request_cap=cap) == k
    assert choose_k(20000, 1, TEXT, GB10, request_cap=cap) == 0  # a cap never turns speculation on


def test_profile_max_draft_tokens_caps_every_rule():
    p = DeviceProfile(name="t", max_draft_tokens=2, speculation=[SpeculationRule(max_context=10**9, k=8)])
    assert choose_k(10, 1, TEXT, p) == 2
    assert choose_k(10, 1, TEXT, p, request_cap=64) == 2


def test_no_rule_means_no_speculation():
    assert choose_k(10, 1, TEXT, DeviceProfile(name="t")) == 0


def test_first_matching_rule_wins_and_workload_rules_are_skipped_for_other_classes():
    p = DeviceProfile(name="t", max_draft_tokens=8, speculation=[
        SpeculationRule(max_context=100, k=1, workload=SCHEMA),
        SpeculationRule(max_context=100, k=6),
        SpeculationRule(max_context=100, k=2),
    ])
    assert choose_k(50, 1, SCHEMA, p) == 1
    assert choose_k(50, 1, TEXT, p) == 6
    assert choose_k(100, 1, TEXT, p) == 0


@given(st.integers(0, 200_000), st.integers(1, 64), st.sampled_from([TEXT, SCHEMA]),
       st.sampled_from(sorted(builtin_profiles())), st.none() | st.integers(-2, 70))
def test_k_is_within_bounds_and_monotone_in_the_cap(context, concurrency, workload, name, cap):
    profile = builtin_profiles()[name]
    k = choose_k(context, concurrency, workload, profile, cap)
    uncapped = choose_k(context, concurrency, workload, profile)
    assert 0 <= k <= uncapped <= profile.max_draft_tokens
    if cap is not None:
        assert k == min(uncapped, max(cap, 0))


@given(st.integers(0, 200_000), st.integers(1, 63))
def test_gb10_more_streams_never_raise_k(context, concurrency):
    assert choose_k(context, concurrency + 1, TEXT, GB10) <= choose_k(context, concurrency, TEXT, GB10)


H200 = builtin_profiles()["h200"]


# The H200 grid's cells (BENCHMARKS.md, code edits): the best fixed K per (context, streams); 32 streams take 7
# (the largest verify graph is 256 tokens); 16k context with 16+ streams lost with speculation on; up to 4 streams
# below 8k context the cap is 16 (K 8 against 4 doubled code edits at one stream).
@pytest.mark.parametrize("context,streams,k", [
    (512, 1, 16), (512, 4, 16), (512, 5, 8), (512, 16, 8), (512, 32, 7),
    (4096, 1, 16), (4096, 4, 16), (4096, 16, 8), (4096, 32, 7), (8192, 1, 8),
    (16384, 1, 8), (16384, 4, 8), (16384, 16, 0), (16384, 32, 0), (4096, 64, 0),
])
def test_h200_profile_follows_its_grid(context, streams, k):
    assert choose_k(context, streams, TEXT, H200) == k
    assert choose_k(context, streams, TEXT, H200, request_cap=2) == min(k, 2)
