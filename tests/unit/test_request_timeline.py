"""bench.request_timeline on spans as the OTLP receiver decodes them (tests/otlp_sink.SinkSpan): the parts of a
request's TTFT, a retried admission, traces that lack a part, and the slow tail's summary. The spans of a real
served request are checked end to end in tests/integration/test_migration_llama_server.py."""
from __future__ import annotations

import pytest

from bench import request_timeline as tl
from tests.otlp_sink import SinkSpan

MS = 1_000_000


def _trace(tid: str, t0: int, queue_ms: float, held_ms: float, wait_ms: float, *, beyond=False, named=True,
           admissions: int = 1) -> list[SinkSpan]:
    """Gateway arrival at t0 (ms), 1 ms of parsing, `queue_ms` admitted, 0.5 ms to the worker, 0.2 ms to the backend,
    `held_ms`, then llama-server's `wait_ms` and a 3 ms prompt."""
    adm_start = t0 + 1
    adm_end = adm_start + queue_ms
    worker = adm_end + 0.5
    backend = worker + 0.2
    sent = backend + held_ms
    first = sent + wait_ms + 3.0
    ns = lambda ms: int(round(ms * MS))  # noqa: E731
    spans = [SinkSpan("POST /v1/completions", tid, "s", "", "pulse", start_ns=ns(t0), end_ns=ns(first + 50))]
    for i in range(admissions - 1):  # refused once each: an earlier, shorter admission
        spans.append(SinkSpan("pulse.admission", tid, f"a{i}", "s", "pulse", start_ns=ns(t0 + 1),
                              end_ns=ns(t0 + 1.1)))
    spans += [
        SinkSpan("pulse.admission", tid, "a", "s", "pulse", start_ns=ns(adm_start), end_ns=ns(adm_end)),
        SinkSpan("pulse.prefill", tid, "p", "s", "pulse", start_ns=ns(worker), end_ns=ns(first + 0.1)),
        SinkSpan("pulse.llama_server", tid, "l", "p", "pulse", start_ns=ns(backend), end_ns=ns(first + 40),
                 events=["pulse.llama_server.sent", "pulse.llama_server.first_token"],
                 event_times_ns=[ns(sent), ns(first)],
                 attributes={"pulse.llama_server.prompt_ms": 3.0, "pulse.llama_server.beyond_slots": beyond,
                             "pulse.llama_server.slot_named": 2 if named else -1, "pulse.llama_server.slot": 2}),
    ]
    return spans


def test_a_requests_ttft_splits_into_parts_that_add_up():
    (row,) = tl.timelines(_trace("t", 1000, queue_ms=7, held_ms=2, wait_ms=40, beyond=True, named=False))
    assert row["ttft_ms"] == pytest.approx(1 + 7 + 0.5 + 0.2 + 2 + 40 + 3)
    assert (row["gateway_queue_ms"], row["to_worker_ms"], row["held_ms"], row["server_wait_ms"], row["prompt_ms"]) \
        == pytest.approx((7, 0.5, 2, 40, 3))
    assert row["other_ms"] == pytest.approx(1.2)
    assert sum(row[p] for p in tl.PARTS) == pytest.approx(row["ttft_ms"])
    assert row["beyond_slots"] and not row["named"] and row["slot"] == 2 and row["admissions"] == 1


def test_a_refused_request_counts_its_last_admission_and_incomplete_traces_are_left_out():
    retried = _trace("r", 1000, queue_ms=5, held_ms=0, wait_ms=1, admissions=3)
    (row,) = tl.timelines(retried)
    assert row["admissions"] == 3 and row["gateway_queue_ms"] == pytest.approx(5)
    no_first = _trace("h", 1000, 1, 0, 1)
    llama = no_first[-1]
    llama.events, llama.event_times_ns = ["pulse.llama_server.sent"], llama.event_times_ns[:1]
    direct_only = [s for s in _trace("d", 1000, 1, 0, 1) if s.name == "pulse.llama_server"]
    assert tl.timelines(no_first + direct_only) == []


def test_the_summary_names_the_part_a_tail_lives_in():
    spans = []
    for i in range(18):  # fast requests: a short gateway queue
        spans += _trace(f"f{i}", 1000 + i, queue_ms=1, held_ms=0, wait_ms=2)
    for i in range(2):  # the slowest tenth waited in llama-server, sent beyond the slots
        spans += _trace(f"s{i}", 1000 + 30 + i, queue_ms=1, held_ms=0, wait_ms=500, beyond=True)
    rows = tl.timelines(spans)
    assert [r["arrive_ns"] for r in rows] == sorted(r["arrive_ns"] for r in rows)
    m = tl.summarize(rows)
    assert m["trace_requests"] == 20 and m["trace_refused_again"] == 0
    assert m["trace_tail_server_wait_mean_ms"] == pytest.approx(500)
    assert m["trace_tail_gateway_queue_mean_ms"] == pytest.approx(1)
    assert m["trace_tail_beyond_frac"] == 1.0 and m["trace_beyond_frac"] == pytest.approx(0.1)
    assert m["trace_server_wait_p50_ms"] == pytest.approx(2) and m["trace_server_wait_p99_ms"] == pytest.approx(500)
    (line,) = tl.lines(rows, "pulse run 0: ")
    assert line.startswith("pulse run 0: 20 traced requests") and "server_wait 500.0" in line
    assert "beyond the slots 100% of them (10% of all)" in line
    assert tl.summarize([]) == {"trace_requests": 0} and tl.lines([]) == ["no traced request"]
