"""The gateway's recent history for the status page: a reading every `sample_s`, kept in bounded rings.

    history = History(sample_s=2.0, history_s=900)
    history.add(Reading(...))            # the sampler, every sample_s
    history.window(60)                   # figures over the last minute (requests/s, TTFT p50/p99, ...)
    history.points(since=wall_time)      # chart points over the last 15 minutes

A Reading holds cumulative counts (histogram buckets, request counts, token counts), so any window's
figures are the difference of two readings; the per-request hot path does nothing for this page beyond
what /metrics already records. Latency quantiles come from Prometheus histogram buckets, interpolated
inside the bucket the way Prometheus' histogram_quantile does: an estimate whose error is the bucket's
width (gateway/metrics.py sets the bounds).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last

CHART_TTFT_WINDOW_S = 10  # a chart point's TTFT is the median over this many trailing seconds


@dataclass(frozen=True)
class Reading:
    mono: float  # time.monotonic() when taken
    wall: float  # time.time() when taken (what the page's charts plot)
    tokens_per_s: float  # generated tokens/s summed over healthy workers (their recent rate)
    waiting: int  # requests waiting: the gateway's admission queue plus the workers' own queues
    ttft: Buckets = ()
    itl: Buckets = ()
    counts: dict[str, float] = field(default_factory=dict)  # cumulative: requests by class, tokens, ...


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of the observations counted in `buckets`; None when there are none."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower  # past the last finite bound: all Prometheus can say is "at least"
            return lower + (upper - lower) * (rank - below) / (count - below)
        if not math.isinf(upper):
            lower = upper
        below = count
    return lower


def bucket_delta(new: Buckets, old: Buckets) -> Buckets:
    """The observations between two readings of one histogram (an empty old reading counts as zero)."""
    before = dict(old)
    return tuple((le, max(count - before.get(le, 0.0), 0.0)) for le, count in new)


class History:
    """Readings for the minute figures (`minute_s` + 1 of them) and chart points for `history_s`."""

    def __init__(self, *, sample_s: float = 2.0, history_s: float = 900.0, minute_s: float = 60.0):
        self.sample_s = sample_s
        self._recent: deque[Reading] = deque(maxlen=int(minute_s / sample_s) + 1)
        self._points: deque[tuple[float, float, float | None, int]] = deque(maxlen=int(history_s / sample_s))

    def add(self, r: Reading) -> None:
        self._recent.append(r)
        back = self._ago(CHART_TTFT_WINDOW_S)
        ttft = quantile(0.5, bucket_delta(r.ttft, back.ttft)) if back is not r else None
        self._points.append((round(r.wall, 3), round(r.tokens_per_s, 2),
                             None if ttft is None else round(ttft * 1000, 2), r.waiting))

    def latest(self) -> Reading | None:
        return self._recent[-1] if self._recent else None

    def window(self, seconds: float) -> dict:
        """Rates, counts and latency quantiles over the last `seconds` (or since the first reading)."""
        if len(self._recent) < 2:
            return {"seconds": 0.0, "rates": {}, "counts": {}, "ttft_ms": {}, "itl_ms": {}}
        new, old = self._recent[-1], self._ago(seconds)
        span = max(new.mono - old.mono, 1e-9)
        counts = {k: v - old.counts.get(k, 0.0) for k, v in new.counts.items()}
        ttft, itl = bucket_delta(new.ttft, old.ttft), bucket_delta(new.itl, old.itl)
        return {"seconds": round(span, 1), "counts": {k: round(v, 3) for k, v in counts.items()},
                "rates": {k: round(v / span, 3) for k, v in counts.items()},
                "ttft_ms": _ms(ttft), "itl_ms": _ms(itl)}

    def points(self, since: float | None = None) -> list[tuple[float, float, float | None, int]]:
        """Chart points (wall time, tokens/s, TTFT p50 ms or None, waiting) taken after `since`."""
        if since is None:
            return list(self._points)
        return [p for p in self._points if p[0] > since]

    def _ago(self, seconds: float) -> Reading:
        """The oldest kept reading no more than `seconds` older than the newest."""
        newest = self._recent[-1]
        for r in self._recent:
            if newest.mono - r.mono <= seconds + self.sample_s / 2:
                return r
        return newest


def _ms(buckets: Buckets) -> dict:
    p50, p99 = quantile(0.5, buckets), quantile(0.99, buckets)
    return {"count": int(buckets[-1][1]) if buckets else 0,
            "p50": None if p50 is None else round(p50 * 1000, 2),
            "p99": None if p99 is None else round(p99 * 1000, 2)}
