"""One trace across the real path (gateway replica -> worker actor, separate Ray processes) exported over
OTLP to a real receiver; and /metrics after traffic shows every documented metric."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import LOADTEST_CONFIG, PulseProcess
from tests.otlp_sink import OtlpSink
from workers.protocol import telemetry as tm

ROOT = Path(__file__).resolve().parents[2]


def chat(base: str, headers: dict | None = None, **extra) -> dict:
    body = json.dumps({"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, **extra}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read()) if not extra.get("stream") else {"raw": r.read()}


@pytest.fixture(scope="module")
def traced_server(tmp_path_factory):
    with OtlpSink() as sink:
        env = {**sink.env("http/protobuf"), "OTEL_BSP_SCHEDULE_DELAY": "200"}
        srv = PulseProcess([], LOADTEST_CONFIG, tmp_path_factory.mktemp("otel"), env=env).wait_ready()
        try:
            yield srv, sink
        finally:
            srv.stop()


def test_one_trace_from_gateway_to_worker(traced_server):
    srv, sink = traced_server
    parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    chat(srv.base, {"traceparent": f"00-{parent_trace}-00f067aa0ba902b7-01"})
    want = {tm.SPAN_PREFILL, tm.SPAN_DECODE, tm.SPAN_ROUTE, tm.SPAN_ADMISSION, "POST /v1/chat/completions"}
    spans = sink.wait_for(lambda s: want <= {x.name for x in s if x.trace_id == parent_trace}, 20)
    mine = {s.name: s for s in spans if s.trace_id == parent_trace}
    http = mine["POST /v1/chat/completions"]
    assert http.parent_span_id == "00f067aa0ba902b7"  # continues the caller's trace
    assert http.attributes["gen_ai.request.model"] == "gemma-3-270m"
    assert http.attributes["gen_ai.usage.output_tokens"] == 4
    assert http.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert mine[tm.SPAN_ADMISSION].parent_span_id == http.span_id
    assert mine[tm.SPAN_ROUTE].parent_span_id == mine[tm.SPAN_ADMISSION].span_id
    assert mine[tm.SPAN_ADMISSION].attributes[tm.PULSE_ADMISSION_RESULT] == "admit"
    for name in (tm.SPAN_PREFILL, tm.SPAN_DECODE):
        assert mine[name].parent_span_id == http.span_id, name
        assert mine[name].resource.get("pulse.role") == "worker"
    assert http.resource.get("pulse.role") == "gateway"
    assert tm.EVENT_FIRST_TOKEN in mine[tm.SPAN_DECODE].events
    assert mine[tm.SPAN_DECODE].attributes["gen_ai.usage.output_tokens"] == 4


def test_metrics_after_traffic_show_every_documented_metric(traced_server):
    srv, _ = traced_server
    chat(srv.base)
    chat(srv.base, stream=True)
    with urllib.request.urlopen(srv.base + "/metrics") as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    documented = re.findall(r"^\| `(pulse_\w+)` \| (\w+) \|", (ROOT / "docs/METRICS.md").read_text(), re.M)
    names = {n.removesuffix("_total") for n in families}
    missing = [n for n, _ in documented if n.removesuffix("_total") not in names]
    assert not missing, missing
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("pulse_requests_total", (("api", "chat"), ("model", "gemma-3-270m"), ("status", "200")))] >= 2
    assert any(n == "pulse_worker_running_sequences" for n, _ in samples)
    assert samples[("pulse_generated_tokens_total", (("model", "gemma-3-270m"),))] >= 8
