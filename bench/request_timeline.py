"""Where a request's time to first token went, from the spans `pulse serve` exports (one trace a request).

A benchmark that passes an OTLP receiver's variables to `pulse serve` (tests/otlp_sink.py; the parity bench's
`--trace`) gets, per request, the gateway's server span (arrival), its `pulse.admission` span (the queue: the
last one, a request a worker refused enters again), the worker's `pulse.prefill` span (arrival at the worker)
and the llama-server backend's `pulse.llama_server` span with its `sent` and `first_token` events and
llama-server's own `prompt_ms`. Each request's TTFT at the worker (its first token there − arrival at the gateway)
splits into:

- `gateway_queue_ms`: the admission span (the gateway's queue, routing included);
- `to_worker_ms`: admitted → the worker's span starts (the hop, the worker's own request handling);
- `held_ms`: the backend's span start → sent (the hold for requests ahead of it, workers/llama_server/slots.py);
- `server_wait_ms`: sent → the first token, less llama-server's prompt_ms: its HTTP thread, its queue (a request sent
  beyond the slots, or deferred), the steps it waited for a launch;
- `prompt_ms`: llama-server's own prefill time;
- `other_ms`: the rest (the gateway before admission: auth, parsing, templating; the worker before the backend).

`summarize` gives each part's p50 and p99 over a run, and for the slowest tenth of requests by TTFT each part's
mean and how many were sent beyond the slots or to a named slot: which part a TTFT tail lives in. Spans are
stamped by each process's wall clock (one box, one clock).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from bench.loadgen import percentiles

PARTS = ("gateway_queue_ms", "to_worker_ms", "held_ms", "server_wait_ms", "prompt_ms", "other_ms")


def _ms(ns: int) -> float:
    return ns / 1e6


def timelines(spans: Iterable) -> list[dict]:
    """One row per trace that has a gateway server span and a `pulse.llama_server` span with its sent and first-token
    events."""
    by_trace: dict[str, list] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    rows = []
    for trace_spans in by_trace.values():
        server = [s for s in trace_spans if s.name.startswith(("POST ", "GET "))]
        admission = [s for s in trace_spans if s.name == "pulse.admission"]
        prefill = [s for s in trace_spans if s.name == "pulse.prefill"]
        llama = [s for s in trace_spans if s.name == "pulse.llama_server"]
        if not (server and admission and prefill and llama):
            continue
        ll = llama[-1]
        events = dict(zip(ll.events, ll.event_times_ns))
        sent, first = events.get("pulse.llama_server.sent"), events.get("pulse.llama_server.first_token")
        if sent is None or first is None:
            continue
        arrive = min(s.start_ns for s in server)
        adm = max(admission, key=lambda s: s.end_ns)
        worker = max(prefill, key=lambda s: s.start_ns)
        prompt_ms = float(ll.attributes.get("pulse.llama_server.prompt_ms", 0.0))
        row = {
            "arrive_ns": arrive,
            "ttft_ms": _ms(first - arrive),
            "gateway_queue_ms": _ms(adm.end_ns - adm.start_ns),
            "to_worker_ms": _ms(worker.start_ns - adm.end_ns),
            "held_ms": _ms(sent - ll.start_ns),
            "server_wait_ms": _ms(first - sent) - prompt_ms,
            "prompt_ms": prompt_ms,
            "beyond_slots": bool(ll.attributes.get("pulse.llama_server.beyond_slots", False)),
            "named": int(ll.attributes.get("pulse.llama_server.slot_named", -1)) >= 0,
            "slot": int(ll.attributes.get("pulse.llama_server.slot", -1)),
            "admissions": len(admission),
        }
        row["other_ms"] = row["ttft_ms"] - sum(row[p] for p in PARTS[:-1])
        rows.append(row)
    rows.sort(key=lambda r: r["arrive_ns"])
    return rows


def summarize(rows: list[dict]) -> dict:
    """Flat metrics for a bench record (`trace_` + name): every part's p50/p99 over the run, and the slow tail's
    share of each part (its mean), of requests sent beyond the slots and of those sent to a named slot. Percentiles
    as the bench's own TTFT ones (bench.loadgen.percentiles); the slow tail: the requests at or above the p90."""
    if not rows:
        return {"trace_requests": 0}
    ttft = percentiles([r["ttft_ms"] for r in rows], scale=1.0)
    out: dict = {"trace_requests": len(rows), "trace_ttft_p50_ms": ttft["p50"], "trace_ttft_p99_ms": ttft["p99"]}
    for part in PARTS:
        q = percentiles([r[part] for r in rows], scale=1.0)
        out[f"trace_{part[:-3]}_p50_ms"], out[f"trace_{part[:-3]}_p99_ms"] = q["p50"], q["p99"]
    tail = [r for r in rows if r["ttft_ms"] >= ttft["p90"]]
    for part in PARTS:
        out[f"trace_tail_{part[:-3]}_mean_ms"] = statistics.fmean(r[part] for r in tail)
    out["trace_tail_ttft_mean_ms"] = statistics.fmean(r["ttft_ms"] for r in tail)
    out["trace_tail_beyond_frac"] = sum(r["beyond_slots"] for r in tail) / len(tail)
    out["trace_beyond_frac"] = sum(r["beyond_slots"] for r in rows) / len(rows)
    out["trace_tail_named_frac"] = sum(r["named"] for r in tail) / len(tail)
    out["trace_refused_again"] = sum(r["admissions"] > 1 for r in rows)
    return out


def lines(rows: list[dict], label: str = "") -> list[str]:
    """A short account of one run for a bench's verdict lines."""
    m = summarize(rows)
    if not m["trace_requests"]:
        return [f"{label}no traced request"]
    parts = ", ".join(f"{p[:-3]} {m[f'trace_tail_{p[:-3]}_mean_ms']:.1f}" for p in PARTS)
    return [f"{label}{m['trace_requests']} traced requests, TTFT p50 {m['trace_ttft_p50_ms']:.1f} / p99 "
            f"{m['trace_ttft_p99_ms']:.1f} ms; the slowest tenth (mean {m['trace_tail_ttft_mean_ms']:.1f} ms): "
            f"{parts} ms; beyond the slots {m['trace_tail_beyond_frac']:.0%} of them ({m['trace_beyond_frac']:.0%} "
            f"of all), named {m['trace_tail_named_frac']:.0%}"]
