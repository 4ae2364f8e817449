"""CPU of two per-request pieces of the gateway's hot path, with and without their cheaper form.

- spans: a request's root span plus three child spans (auth, admission, route) and the trace context sent to
  the worker, with no exporter configured: the SDK tracer against QuietTracer (gateway/spans.py);
- deltas: 16 streamed text deltas of a chat completion, each chunk built and JSON-encoded whole against
  ChatEvents' pre-encoded frame around the text (gateway/completions.py).

Process CPU time per request-equivalent; median and min/max over repeats, interleaved.

    python -m bench.gateway_hotpath [--repeats 7] [--n 3000]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence


def cases() -> dict[str, Callable[[], object]]:
    from gateway.completions import ChatEvents, _event
    from gateway.responses import Shaper
    from gateway.spans import QuietTracer
    from policy.config import TelemetryConfig
    from workers.protocol import telemetry as tm

    raw = tm.setup_tracing(TelemetryConfig(traces_exporter="none"), "gateway", set_global=False).get_tracer("bench")
    shaper = Shaper("chat", "chatcmpl-0123456789abcdef", 1_700_000_000, "gemma-3-270m", str)

    def spans(tracer) -> None:
        with tracer.start_as_current_span("POST /v1/chat/completions", context=tm.extract_context({}),
                                          kind=tm.trace.SpanKind.SERVER):
            for name in ("pulse.admission.auth", "pulse.admission", "pulse.route"):
                with tracer.start_as_current_span(name) as span:
                    span.set_attribute("pulse.worker", "w0")
            tm.inject_context()

    def framed() -> list[bytes]:
        events = ChatEvents(shaper, include_usage=False)
        return [events.delta(f" t{i}", None, False) for i in range(16)]

    return {"spans, SDK tracer": lambda: spans(raw), "spans, QuietTracer": lambda: spans(QuietTracer(raw)),
            "16 deltas, whole chunk": lambda: [_event(shaper.stream_chunk(f" t{i}", None, None, False))
                                               for i in range(16)],
            "16 deltas, framed": framed}


def cpu_us(fn: Callable[[], object], n: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_hotpath", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--n", type=int, default=3000, help="calls per timing")
    args = ap.parse_args(argv)
    runs = cases()
    got: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            got[name].append(cpu_us(fn, args.n))
    for name, values in got.items():
        print(f"{name:24s} {statistics.median(values):7.1f} us CPU per request ({min(values):.1f}-{max(values):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
