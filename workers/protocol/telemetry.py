"""Tracing and structured logging, shared by the gateway and the workers.

Tracing uses the OpenTelemetry SDK and honours the standard ``OTEL_*`` variables (exporter, endpoint,
protocol, headers, sampler, resource attributes, batch processor); ``TelemetryConfig`` fields win where
set. Trace context crosses process boundaries as W3C ``traceparent``/``tracestate`` strings in a plain
dict (``inject_context`` / ``extract_context``): HTTP ingress -> ``GenerateRequest.trace_context`` ->
worker -> llama-server request headers.

Only the OpenTelemetry *API* is imported here; the SDK and exporters (gRPC is heavy) load inside
``setup_tracing``, so importing ``workers.protocol`` stays cheap.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter

if TYPE_CHECKING:  # heavy or cross-package imports only for type checkers
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from policy.config import TelemetryConfig

# Span names (documented in docs/METRICS.md). The HTTP server span follows OTel's HTTP convention,
# "{method} {route}", e.g. "POST /v1/chat/completions"; the generation span, GenAI's
# "{gen_ai.operation.name} {gen_ai.request.model}" (see `genai_span_name`).
SPAN_ADMISSION = "pulse.admission"  # auth + per-key quota + admission decision
SPAN_PREFIX_LOOKUP = "pulse.prefix_lookup"  # longest cached prefix per worker (index round trip)
SPAN_ROUTE = "pulse.route"  # choosing the worker
SPAN_QUEUE_WAIT = "pulse.queue_wait"  # in the worker, from arrival to the first scheduled step
SPAN_PREFILL = "pulse.prefill"  # prompt processing up to the first generated token
SPAN_DECODE = "pulse.decode"  # first token to finish; EVENT_FIRST_TOKEN marks its start
SPAN_LLAMA_SERVER = "pulse.llama_server"  # one HTTP call to a managed llama-server (kind CLIENT)
EVENT_FIRST_TOKEN = "pulse.first_token"

# OpenTelemetry GenAI semantic conventions (attribute names as the spec spells them).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_SYSTEM = "gen_ai.system"  # older spelling, still read by many backends
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"  # newer spelling of the same fact
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"  # Pulse's x-session-id
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # string array
GEN_AI_PROVIDER_VALUE = "pulse"

# Pulse's own attributes.
PULSE_ROLE = "pulse.role"  # resource attribute: "gateway" | "worker"
PULSE_WORKER = "pulse.worker"
PULSE_BACKEND = "pulse.backend"
PULSE_CACHED_TOKENS = "pulse.cached_tokens"
PULSE_PREFIX_MATCHED_TOKENS = "pulse.prefix.matched_tokens"  # what the index predicted (routing)
PULSE_SPECULATION_K = "pulse.speculation.k"
PULSE_DRAFTED_TOKENS = "pulse.drafted_tokens"
PULSE_ACCEPTED_TOKENS = "pulse.accepted_tokens"
PULSE_ROUTE_REASON = "pulse.route.reason"  # e.g. "prefix", "load", "session"
PULSE_ADMISSION_RESULT = "pulse.admission.result"  # "admitted" or the rejection reason
PULSE_QUEUE_DEPTH = "pulse.queue.depth"
# the `pulse.llama_server` span (workers/llama_server/backend.py)
PULSE_LLAMA_LANE = "pulse.llama_server.lane"
PULSE_LLAMA_SLOT_NAMED = "pulse.llama_server.slot_named"  # the slot Pulse asked for (id_slot); -1: none
PULSE_LLAMA_SLOT = "pulse.llama_server.slot"  # the slot it ran in: the one named, else its events' id_slot
PULSE_LLAMA_BEYOND_SLOTS = "pulse.llama_server.beyond_slots"  # every slot had a request when it came
PULSE_LLAMA_RUNNING = "pulse.llama_server.running"  # the lane's requests in flight when it came, itself excluded
PULSE_LLAMA_PROMPT_MS = "pulse.llama_server.prompt_ms"  # llama-server's timings: prompt_ms, predicted_ms, ...
PULSE_LLAMA_PREDICTED_MS = "pulse.llama_server.predicted_ms"
PULSE_LLAMA_PROMPT_N = "pulse.llama_server.prompt_n"
PULSE_LLAMA_CACHE_N = "pulse.llama_server.cache_n"
PULSE_LLAMA_PREDICTED_N = "pulse.llama_server.predicted_n"
EVENT_LLAMA_SENT = "pulse.llama_server.sent"  # the request went to llama-server (after any hold)
EVENT_LLAMA_HEADERS = "pulse.llama_server.headers"  # its response headers came
EVENT_LLAMA_FIRST_TOKEN = "pulse.llama_server.first_token"  # its first event with a token

EXPORTERS = ("otlp", "console", "memory", "none")


def setup_tracing(
    config: TelemetryConfig | None,
    role: str,
    *,
    exporter: SpanExporter | None = None,
    set_global: bool = True,
) -> TracerProvider:
    """Build this process's TracerProvider; call once per process (gateway replica, worker actor).

    Exporter choice: ``exporter`` if given (tests), else ``config.traces_exporter``, else
    ``OTEL_TRACES_EXPORTER`` (comma-separated, default "none"). "none" still creates ids (sampler off)
    so log lines carry a trace id and incoming context still propagates, at near-zero cost.
    The returned provider has ``.exporters`` (the span exporters in use, e.g. the in-memory one).
    Call ``provider.shutdown()`` at exit to flush batched spans.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    names = _exporter_names(config)
    exporters = [exporter] if exporter is not None else [_make_exporter(n) for n in names if n != "none"]
    service = (config.service_name if config else None) or os.environ.get("OTEL_SERVICE_NAME") or "pulse"
    # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES; explicit keys here win.
    resource = Resource.create({"service.name": service, PULSE_ROLE: role})
    kwargs: dict[str, Any] = {"resource": resource}
    if not exporters and "OTEL_TRACES_SAMPLER" not in os.environ:
        kwargs["sampler"] = ALWAYS_OFF  # nothing exports: skip recording, keep ids for logs
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        exporters, kwargs["sampler"] = [], ALWAYS_OFF
    provider = TracerProvider(**kwargs)
    for exp in exporters:
        # In-memory and console exporters are synchronous so tests see spans as soon as they end;
        # network exporters batch on a background thread (OTEL_BSP_* tune it) off the request path.
        batch = type(exp).__name__.startswith("OTLP")
        provider.add_span_processor(BatchSpanProcessor(exp) if batch else SimpleSpanProcessor(exp))
    provider.exporters = exporters  # type: ignore[attr-defined]
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def _exporter_names(config: TelemetryConfig | None) -> list[str]:
    chosen = config.traces_exporter if config is not None else None
    raw = chosen or os.environ.get("OTEL_TRACES_EXPORTER") or "none"
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"unknown traces exporter {unknown}; expected one of {EXPORTERS}")
    return names


def _make_exporter(name: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(service_name=None)
    if name == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        return InMemorySpanExporter()
    protocol = otlp_protocol()
    # The OTLP exporters read OTEL_EXPORTER_OTLP_[TRACES_]{ENDPOINT,HEADERS,TIMEOUT,COMPRESSION,...} themselves.
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def otlp_protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else "grpc" (as Python's distro)."""
    env = os.environ
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTLP protocol {protocol!r} not supported; use grpc or http/protobuf")
    return protocol


# --- context propagation -------------------------------------------------------------------------


class _AnyCaseGetter(Getter):
    """Reads a carrier whatever its key case: plain dicts, aiohttp/starlette headers, msgspec dicts."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None and isinstance(carrier, dict):
            for k, v in carrier.items():  # only plain dicts are case-sensitive; header types are not
                if k.lower() == key:
                    value = v
                    break
        if value is None:
            return None
        return [value] if isinstance(value, str) else list(value)

    def keys(self, carrier: Any) -> list[str]:
        return list(carrier.keys())


_getter = _AnyCaseGetter()


def inject_context(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The current (or given) span's context as headers: {"traceparent": ..., "tracestate": ...}.

    Empty when there is no valid span. Put the result in GenerateRequest.trace_context, in Ray call
    arguments, and in the headers of the llama-server request. Uses the global propagator, which is
    W3C trace context + baggage unless OTEL_PROPAGATORS says otherwise.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract_context(carrier: Mapping[str, Any] | Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """A Context from incoming headers or a dict made by `inject_context` (any key case).

    Pass it as ``context=`` to ``tracer.start_as_current_span``; an empty or invalid carrier gives a
    context with no parent, so the span starts a new trace.
    """
    if not carrier:
        return otel_context.Context()
    if not hasattr(carrier, "get"):
        carrier = dict(carrier)
    return propagate.extract(carrier, context=otel_context.Context(), getter=_getter)


def current_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span as lowercase hex, or None outside any valid span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


# --- attribute helpers (cheap no-ops on spans that are not recorded) -------------------------------


def genai_span_name(operation: str, model: str) -> str:
    """GenAI's span name: "{gen_ai.operation.name} {gen_ai.request.model}", e.g. "chat gemma-3-270m"."""
    return f"{operation} {model}"


def set_request_attributes(
    span: trace.Span,
    *,
    model: str,
    operation: str = "chat",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stream: bool | None = None,
    session_id: str | None = None,
) -> None:
    """Set GenAI request attributes on a span (skipped when the span is not recording)."""
    if not span.is_recording():
        return
    attrs: dict[str, Any] = {
        GEN_AI_OPERATION_NAME: operation,
        GEN_AI_SYSTEM: GEN_AI_PROVIDER_VALUE,
        GEN_AI_PROVIDER_NAME: GEN_AI_PROVIDER_VALUE,
        GEN_AI_REQUEST_MODEL: model,
    }
    for key, value in (
        (GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
        (GEN_AI_REQUEST_TEMPERATURE, temperature),
        (GEN_AI_REQUEST_TOP_P, top_p),
        (GEN_AI_REQUEST_SEED, seed),
        (GEN_AI_REQUEST_STREAM, stream),
        (GEN_AI_CONVERSATION_ID, session_id),
    ):
        if value is not None:
            attrs[key] = value
    span.set_attributes(attrs)


def set_usage_attributes(span: trace.Span, usage: Any, finish_reason: str | None = None, k: int | None = None) -> None:
    """Set token counts from a workers.protocol.Usage (or anything with its fields) and the finish reason."""
    if not span.is_recording():
        return
    attrs: dict[str, Any] = {
        GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
        GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens,
        PULSE_CACHED_TOKENS: usage.cached_tokens,
        PULSE_DRAFTED_TOKENS: usage.drafted_tokens,
        PULSE_ACCEPTED_TOKENS: usage.accepted_tokens,
    }
    if finish_reason is not None:
        attrs[GEN_AI_RESPONSE_FINISH_REASONS] = (finish_reason,)
    if k is not None:
        attrs[PULSE_SPECULATION_K] = k
    span.set_attributes(attrs)


def first_token_event(span: trace.Span) -> None:
    """Mark the first generated token on the decode (or generation) span."""
    if span.is_recording():
        span.add_event(EVENT_FIRST_TOKEN)


# Logging lives in its own module to keep this one short; re-exported so callers import one place.
from workers.protocol.telemetry_logging import JsonFormatter, RedactFilter, TextFormatter, redact, setup_logging  # noqa: E402

__all__ = [name for name in dir() if name.isupper() and name != "TYPE_CHECKING"] + [
    "setup_tracing",
    "otlp_protocol",
    "inject_context",
    "extract_context",
    "current_ids",
    "genai_span_name",
    "set_request_attributes",
    "set_usage_attributes",
    "first_token_event",
    "setup_logging",
    "JsonFormatter",
    "RedactFilter",
    "TextFormatter",
    "redact",
]
