"""QuietTracer (the gateway's and the workers'): real child spans when spans are recorded, none when they are not."""
from __future__ import annotations

from policy.config import TelemetryConfig
from workers.protocol import telemetry as t
from workers.protocol.spans import QuietTracer


def _run(tracer) -> tuple[object, object]:
    ctx = t.extract_context({})
    with tracer.start_as_current_span("POST /v1/chat/completions", context=ctx) as root:
        with tracer.start_as_current_span("pulse.route") as child:
            child.set_attribute("pulse.worker", "w0")
    return root, child


def test_recorded_children_are_real_spans():
    provider = t.setup_tracing(TelemetryConfig(traces_exporter="memory"), "gateway", set_global=False)
    root, child = _run(QuietTracer(provider.get_tracer("test")))
    spans = {s.name: s for s in provider.exporters[0].get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "pulse.route"}
    assert spans["pulse.route"].parent.span_id == spans["POST /v1/chat/completions"].context.span_id
    assert spans["pulse.route"].attributes["pulse.worker"] == "w0"
    assert child is not root


def test_unrecorded_children_are_the_root_and_it_keeps_its_ids():
    provider = t.setup_tracing(TelemetryConfig(traces_exporter="none"), "gateway", set_global=False)
    root, child = _run(QuietTracer(provider.get_tracer("test")))
    assert child is root  # no span was made; set_attribute went to the non-recording root (a no-op)
    assert not root.is_recording()
    assert root.get_span_context().trace_id != 0  # log lines and the worker still get a trace id


def test_unrecorded_root_is_what_the_sdk_makes_with_its_sampler_off():
    provider = t.setup_tracing(TelemetryConfig(traces_exporter="none"), "gateway", set_global=False)
    raw, quiet = provider.get_tracer("test"), QuietTracer(provider.get_tracer("test"))
    incoming = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"}
    made = []
    for tracer in (raw, quiet):
        with tracer.start_as_current_span("POST /v1/chat/completions", context=t.extract_context(incoming)) as root:
            assert t.trace.get_current_span() is root
            made.append((root, t.inject_context()))
        assert not t.trace.get_current_span().get_span_context().is_valid  # the context before is back
    (sdk, sdk_headers), (ours, our_headers) = made
    for span in (sdk, ours):
        ctx = span.get_span_context()
        assert not span.is_recording() and ctx.trace_id == 0x0af7651916cd43dd8448eb211c80319c
        assert ctx.trace_flags == 0 and ctx.trace_state == {"k": "v"} and not ctx.is_remote
        assert ctx.span_id not in (0, 0xb7ad6b7169203331)
    assert sdk_headers["traceparent"][:36] == our_headers["traceparent"][:36]  # version and trace id
    assert sdk_headers["traceparent"][-3:] == our_headers["traceparent"][-3:] == "-00"
    with quiet.start_as_current_span("GET /health", context=t.extract_context({})) as fresh:
        assert fresh.get_span_context().is_valid and fresh.get_span_context().trace_id != sdk.get_span_context().trace_id
