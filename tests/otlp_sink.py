"""A real OTLP trace receiver on loopback (HTTP/protobuf and gRPC), for tests that follow spans across
processes: point OTEL_EXPORTER_OTLP_ENDPOINT of every process (gateway, Ray workers) at it and read back
what the real OTLP exporters sent. It decodes the wire format with opentelemetry-proto; nothing is faked.

    with OtlpSink() as sink:                      # both listeners on free ports
        env = sink.env("http/protobuf")            # OTEL_* variables for the processes under test
        ...
        spans = sink.wait_for(lambda s: len(s) >= 3, timeout=10)
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class SinkSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    event_attributes: list[dict[str, Any]] = field(default_factory=list)  # one dict per event, in order
    resource: dict[str, Any] = field(default_factory=dict)
    start_ns: int = 0  # wall clock (time.time_ns), as the exporting process's SDK stamped it
    end_ns: int = 0
    event_times_ns: list[int] = field(default_factory=list)  # one per event, in order


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SinkSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(SinkSpan(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), service=str(resource.get("service.name", "")),
                    attributes={a.key: _value(a.value) for a in s.attributes},
                    events=[e.name for e in s.events], resource=resource,
                    event_attributes=[{a.key: _value(a.value) for a in e.attributes} for e in s.events],
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    event_times_ns=[e.time_unix_nano for e in s.events],
                ))
    return out


class OtlpSink:
    """Collects spans exported over OTLP/HTTP (POST /v1/traces) and OTLP/gRPC."""

    def __init__(self):
        self.spans: list[SinkSpan] = []
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None
        self._grpc = None
        self.http_port = self.grpc_port = 0

    def _add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.spans.extend(_decode(request))

    def __enter__(self) -> OtlpSink:
        import grpc

        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                ok = self.path == "/v1/traces"
                if ok:
                    sink._add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args):  # keep test output clean
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (gRPC's naming)
                sink._add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait()

    def env(self, protocol: str = "http/protobuf") -> dict[str, str]:
        """OTEL_* variables that send a process's spans here over `protocol`, with no batching delay."""
        port = self.http_port if protocol == "http/protobuf" else self.grpc_port
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }

    def drain(self) -> list[SinkSpan]:
        """The spans received so far, forgotten here (a long bench keeps only what it has not read yet)."""
        with self._lock:
            spans, self.spans = self.spans, []
        return spans

    def wait_for(self, predicate: Callable[[list[SinkSpan]], bool], timeout: float = 10.0) -> list[SinkSpan]:
        """Spans received so far, once `predicate(spans)` holds; AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"OTLP sink: condition not met in {timeout}s; got {[s.name for s in spans]}")
            time.sleep(0.02)
