"""Tracing setup, context propagation across a process boundary, GenAI attributes, and JSON logs."""
from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry import trace

from policy.config import TelemetryConfig
from tests.otlp_sink import OtlpSink
from workers.protocol import GenerateRequest, Usage, encode
from workers.protocol import telemetry as t

OTEL_VARS = [k for k in os.environ if k.startswith("OTEL_")]


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in OTEL_VARS:
        monkeypatch.delenv(k, raising=False)


def memory_provider(role="gateway"):
    provider = t.setup_tracing(TelemetryConfig(traces_exporter="memory"), role, set_global=False)
    return provider, provider.exporters[0]


def test_memory_exporter_records_spans_with_genai_attributes():
    provider, exporter = memory_provider()
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(t.genai_span_name("chat", "gemma-3-270m")) as span:
        t.set_request_attributes(span, model="gemma-3-270m", max_tokens=32, temperature=0.5, session_id="s1")
        with tracer.start_as_current_span(t.SPAN_DECODE) as decode:
            t.first_token_event(decode)
        usage = Usage(prompt_tokens=40, completion_tokens=7, cached_tokens=32, drafted_tokens=8, accepted_tokens=5)
        t.set_usage_attributes(span, usage, "stop", k=4)
    decode_span, top = exporter.get_finished_spans()
    attrs = top.attributes
    assert top.name == "chat gemma-3-270m"
    assert attrs[t.GEN_AI_REQUEST_MODEL] == "gemma-3-270m" and attrs[t.GEN_AI_REQUEST_MAX_TOKENS] == 32
    assert attrs[t.GEN_AI_REQUEST_TEMPERATURE] == 0.5 and attrs[t.GEN_AI_CONVERSATION_ID] == "s1"
    assert attrs[t.GEN_AI_USAGE_INPUT_TOKENS] == 40 and attrs[t.GEN_AI_USAGE_OUTPUT_TOKENS] == 7
    assert attrs[t.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert (attrs[t.PULSE_CACHED_TOKENS], attrs[t.PULSE_SPECULATION_K]) == (32, 4)
    assert (attrs[t.PULSE_DRAFTED_TOKENS], attrs[t.PULSE_ACCEPTED_TOKENS]) == (8, 5)
    assert [e.name for e in decode_span.events] == [t.EVENT_FIRST_TOKEN]
    assert decode_span.parent.span_id == top.context.span_id
    assert top.resource.attributes[t.PULSE_ROLE] == "gateway"
    assert top.resource.attributes["service.name"] == "pulse"


def test_config_wins_over_env_and_env_is_honoured(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    from_env = t.setup_tracing(TelemetryConfig(), "worker", set_global=False)
    assert [type(e).__name__ for e in from_env.exporters] == ["ConsoleSpanExporter"]
    assert from_env.resource.attributes["service.name"] == "from-env"
    cfg = TelemetryConfig(traces_exporter="memory", service_name="from-config")
    from_cfg = t.setup_tracing(cfg, "worker", set_global=False)
    assert [type(e).__name__ for e in from_cfg.exporters] == ["InMemorySpanExporter"]
    assert from_cfg.resource.attributes["service.name"] == "from-config"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        t.setup_tracing(TelemetryConfig(), "worker", set_global=False)


@pytest.mark.parametrize(("protocol", "module"), [("grpc", "proto.grpc"), ("http/protobuf", "proto.http")])
def test_otlp_protocol_picks_exporter(monkeypatch, protocol, module):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    provider = t.setup_tracing(None, "gateway", set_global=False)
    assert module in type(provider.exporters[0]).__module__
    provider.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        t.otlp_protocol()


def test_none_exporter_keeps_ids_but_records_nothing():
    provider = t.setup_tracing(TelemetryConfig(traces_exporter="none"), "gateway", set_global=False)
    with provider.get_tracer("test").start_as_current_span("x") as span:
        assert not span.is_recording()
        assert t.current_ids() is not None  # log lines still correlate
        assert "traceparent" in t.inject_context()
    assert provider.exporters == []


def test_sdk_disabled_gives_no_op_tracer(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    provider = t.setup_tracing(TelemetryConfig(traces_exporter="memory"), "gateway", set_global=False)
    assert provider.exporters == []
    tracer = provider.get_tracer("test")
    assert isinstance(tracer, trace.NoOpTracer)
    with tracer.start_as_current_span("x") as span:
        assert not span.is_recording()


def test_extract_accepts_any_header_case_and_garbage():
    provider, exporter = memory_provider()
    with provider.get_tracer("test").start_as_current_span("parent") as parent:
        carrier = t.inject_context()
    upper = {k.title(): v for k, v in carrier.items()}
    for c in (carrier, upper, list(carrier.items())):
        ctx = t.extract_context(c)
        assert trace.get_current_span(ctx).get_span_context().span_id == parent.get_span_context().span_id
    for bad in (None, {}, {"traceparent": "00-zz-yy-01"}):
        assert not trace.get_current_span(t.extract_context(bad)).get_span_context().is_valid


WORKER_SCRIPT = textwrap.dedent("""
    import sys
    from policy.config import TelemetryConfig
    from workers.protocol import request_decoder
    from workers.protocol import telemetry as t
    provider = t.setup_tracing(TelemetryConfig(), "worker")
    tracer = provider.get_tracer("pulse.worker")
    req = request_decoder.decode(sys.stdin.buffer.read())
    with tracer.start_as_current_span(t.SPAN_PREFILL, context=t.extract_context(req.trace_context)) as s:
        s.set_attribute(t.PULSE_WORKER, "w0")
        downstream = t.inject_context()  # what goes into the llama-server request headers
    with tracer.start_as_current_span(t.SPAN_DECODE, context=t.extract_context(req.trace_context)) as s:
        t.first_token_event(s)
    print(downstream["traceparent"])
    provider.shutdown()
""")


@pytest.mark.parametrize("worker_protocol", ["grpc", "http/protobuf"])
def test_one_trace_across_a_process_boundary_over_otlp(monkeypatch, worker_protocol):
    """The gateway span and a separate worker process's prefill/decode spans form one trace, exported
    by the real OTLP exporters to a real receiver; the context crosses as GenerateRequest.trace_context."""
    with OtlpSink() as sink:
        for k, v in sink.env("http/protobuf").items():
            monkeypatch.setenv(k, v)
        provider = t.setup_tracing(TelemetryConfig(service_name="gw"), "gateway", set_global=False)
        with provider.get_tracer("pulse.gateway").start_as_current_span("POST /v1/chat/completions") as span:
            t.set_request_attributes(span, model="gemma-3-270m", max_tokens=4)
            req = GenerateRequest("r1", [1, 2, 3], 4, trace_context=t.inject_context())
            env = {**os.environ, **sink.env(worker_protocol), "OTEL_SERVICE_NAME": "wk"}
            out = subprocess.run([sys.executable, "-c", WORKER_SCRIPT], input=encode(req), env=env,
                                 capture_output=True, timeout=60, cwd=os.getcwd())
            assert out.returncode == 0, out.stderr.decode()
        provider.shutdown()
        spans = sink.wait_for(lambda s: len(s) >= 3)
    by_name = {s.name: s for s in spans}
    gw, prefill, decode = by_name["POST /v1/chat/completions"], by_name[t.SPAN_PREFILL], by_name[t.SPAN_DECODE]
    assert gw.trace_id == prefill.trace_id == decode.trace_id
    assert prefill.parent_span_id == decode.parent_span_id == gw.span_id
    assert (gw.service, prefill.service) == ("gw", "wk")
    assert prefill.resource[t.PULSE_ROLE] == "worker" and prefill.attributes[t.PULSE_WORKER] == "w0"
    assert gw.attributes[t.GEN_AI_REQUEST_MODEL] == "gemma-3-270m"
    assert decode.events == [t.EVENT_FIRST_TOKEN]
    # the header the worker would send to llama-server names the prefill span as parent, same trace
    _, trace_id, parent_id, _ = out.stdout.decode().strip().split("-")
    assert (trace_id, parent_id) == (gw.trace_id, prefill.span_id)


def log_lines(config, emit) -> list[dict]:
    buf = io.StringIO()
    logger = logging.getLogger("pulse.test.telemetry")
    logger.propagate = False
    handler = t.setup_logging(config, "gateway", stream=buf, logger=logger)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return [json.loads(line) for line in buf.getvalue().splitlines()] if config.log_format == "json" else buf.getvalue()


def test_json_logs_carry_span_ids_and_extras():
    provider, _ = memory_provider()

    def emit(log):
        log.info("outside")
        with provider.get_tracer("test").start_as_current_span("x") as span:
            emit.ids = (format(span.get_span_context().trace_id, "032x"), format(span.get_span_context().span_id, "016x"))
            log.warning("routed %s", "w1", extra={"worker": "w1", "blocks": 3})

    outside, inside = log_lines(TelemetryConfig(), emit)
    assert outside["trace_id"] is None and outside["msg"] == "outside" and outside["role"] == "gateway"
    assert (inside["trace_id"], inside["span_id"]) == emit.ids
    assert inside["msg"] == "routed w1" and inside["level"] == "WARNING"
    assert (inside["worker"], inside["blocks"]) == ("w1", 3)


SECRETS = ("sk-live-0123456789abcdef", "Bearer eyJhbGciOi.J9.abc-_=", "sk-proj-XYZ_987654321")


def test_logs_never_carry_keys():
    def emit(log):
        log.info("headers %s", {"Authorization": "Bearer eyJhbGciOi.J9.abc-_=", "x-api-key": "hunter2hunter2"})
        log.info("key %s rejected", "sk-live-0123456789abcdef", extra={"key": "sk-proj-XYZ_987654321"})
        try:
            raise ValueError("bad key sk-live-0123456789abcdef")
        except ValueError:
            log.exception("failed")

    text = json.dumps(log_lines(TelemetryConfig(), emit))
    for secret in (*SECRETS, "hunter2hunter2", "eyJhbGciOi"):
        assert secret not in text
    assert text.count("[REDACTED]") >= 5
    assert t.redact("task-force Bearer-less token=sk-") == "task-force Bearer-less token=sk-"


def test_text_format_has_trace_ids_and_redacts():
    provider, _ = memory_provider()

    def emit(log):
        with provider.get_tracer("test").start_as_current_span("x"):
            log.info("auth Bearer abc.def")

    line = log_lines(TelemetryConfig(log_format="text"), emit)
    assert "[trace=" in line and "trace=-" not in line and "abc.def" not in line


def test_import_stays_light():
    """workers.protocol.telemetry must not pull the SDK or exporters (gRPC) in at import time."""
    code = ("import sys, workers.protocol.telemetry; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'grpc', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
