"""The status page's history: quantiles from histogram buckets, minute windows, bounded chart rings."""
from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.status import _buckets
from gateway.status_history import History, Reading, bucket_delta, quantile

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    b = ((0.1, 0.0), (1.0, 4.0), (INF, 4.0))
    assert quantile(0.5, b) == pytest.approx(0.55)  # rank 2 of 4 in (0.1, 1.0]
    assert quantile(0.99, b) == pytest.approx(0.1 + 0.9 * 3.96 / 4)
    assert quantile(0.5, ((0.1, 0.0), (INF, 0.0))) is None
    assert quantile(0.5, ()) is None
    assert quantile(0.99, ((0.1, 1.0), (1.0, 1.0), (INF, 3.0))) == 1.0  # past the last bound: "at least"


def test_quantiles_match_real_observations_within_a_bucket():
    reg = CollectorRegistry()
    h = Histogram("t_seconds", "t", ["model"], buckets=(0.01, 0.02, 0.05, 0.1, 0.2), registry=reg)
    for i in range(100):  # 0.001 .. 0.1 s, split across two models (summed by _buckets)
        h.labels(model="a" if i % 2 else "b").observe((i + 1) / 1000)
    b = _buckets(h)
    assert b[-1] == (INF, 100.0)
    assert quantile(0.5, b) == pytest.approx(0.05)  # exactly 50 of 100 are <= 0.05 (true median 0.0505)
    assert quantile(0.99, b) == pytest.approx(0.099)  # true 0.099


def test_bucket_delta_is_the_window_and_never_negative():
    old = ((0.1, 2.0), (INF, 3.0))
    new = ((0.1, 5.0), (INF, 9.0))
    assert bucket_delta(new, old) == ((0.1, 3.0), (INF, 6.0))
    assert bucket_delta(new, ()) == new
    assert bucket_delta(old, new) == ((0.1, 0.0), (INF, 0.0))


def reading(t: float, requests: float, ttft_count: float = 0.0, tps: float = 0.0) -> Reading:
    return Reading(mono=t, wall=1000.0 + t, tokens_per_s=tps, waiting=int(t) % 3,
                   ttft=((0.1, ttft_count), (INF, ttft_count)), counts={"requests": requests})


def test_window_takes_differences_over_the_last_minute_only():
    h = History(sample_s=1.0, history_s=30.0)
    assert h.window(60)["rates"] == {}
    for t in range(0, 121):  # 2 requests a second for 2 minutes
        h.add(reading(float(t), 2.0 * t, ttft_count=float(t)))
    w = h.window(60)
    assert w["seconds"] == 60.0
    assert w["counts"]["requests"] == 120.0 and w["rates"]["requests"] == 2.0
    assert w["ttft_ms"]["count"] == 60 and 0 < w["ttft_ms"]["p50"] <= 100


def test_chart_points_are_bounded_and_resume_after_since():
    h = History(sample_s=1.0, history_s=30.0)
    for t in range(100):
        h.add(reading(float(t), 0.0, ttft_count=float(t // 20), tps=float(t)))
    points = h.points()
    assert len(points) == 30 and points[-1][0] == 1099.0 and points[-1][1] == 99.0
    assert [p[0] for p in h.points(since=1097.0)] == [1098.0, 1099.0]
    assert points[-1][2] is None  # no request in the last 10 s: no TTFT point
    ttft = [p[2] for p in points if p[2] is not None]
    assert ttft and all(0 < v <= 100 for v in ttft)
