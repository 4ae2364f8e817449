"""Gateway metrics: exposition matches docs/METRICS.md, values are right, deploy configs refer to real metrics."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics, WorkerStatsCollector
from workers.protocol import BackendStats, Usage

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


class SpecStats(BackendStats):
    """BackendStats with the speculation/throughput fields proposed for workers/protocol."""

    generated_tokens: int = 0
    speculation_k: int = 0
    steps_by_k: list[int] = []
    drafted_by_position: list[int] = []
    accepted_by_position: list[int] = []


def exposition(m: GatewayMetrics) -> dict[str, object]:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def documented() -> dict[str, str]:
    """metric name -> type, from the table in docs/METRICS.md."""
    rows = re.findall(r"^\| `(pulse_\w+)` \| (\w+) \|", (ROOT / "docs/METRICS.md").read_text(), re.M)
    return dict(rows)


def traffic(m: GatewayMetrics) -> None:
    r = m.request("gemma-3-270m", start=0.0)
    r.chunk(1, now=0.05)
    r.chunk(2, now=0.09)
    r.finish(200, Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=32, drafted_tokens=4,
                        accepted_tokens=2), now=0.1)
    m.record_request("gemma-3-270m", 429, 0.001)
    m.rejected("quota")
    m.migrated("resumed")
    m.routed(4e-5)
    m.prefix_lookup(3e-4, matched_tokens=32, prompt_tokens=40)
    m.queue_depth.inc()


def full_snapshots() -> dict:
    return {
        "w0": SpecStats(running=2, waiting=1, slots=8, kv_blocks_total=100, kv_blocks_used=30, tokens_per_s=50.0,
                        preemptions=1, restarts=2, generated_tokens=500, speculation_k=3, steps_by_k=[5, 0, 0, 9],
                        drafted_by_position=[9, 9, 9], accepted_by_position=[8, 5, 2],
                        forwards_by_path={"graph": 40, "verify": 3, "eager": 7}),
        "w1": msgspec.structs.asdict(BackendStats(running=1, kv_blocks_total=10, kv_blocks_used=10, healthy=False)),
    }


def test_every_documented_metric_is_exposed_and_nothing_else():
    m = GatewayMetrics(worker_snapshots=full_snapshots())
    traffic(m)
    exposed = {}
    for fam in exposition(m).values():
        if fam.name.endswith("_created"):  # the text parser reads prometheus-client's _created samples as gauges
            continue
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        exposed[name] = fam.type
    assert exposed == documented()
    assert all(name.startswith("pulse_") for name in exposed)


def samples(m: GatewayMetrics) -> dict[tuple, float]:
    out = {}
    for fam in exposition(m).values():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_request_values():
    m = GatewayMetrics()
    traffic(m)
    s = samples(m)
    model = ("model", "gemma-3-270m")
    assert s[("pulse_requests_total", (("api", "chat"), model, ("status", "200")))] == 1
    assert s[("pulse_requests_total", (("api", "chat"), model, ("status", "429")))] == 1
    assert s[("pulse_time_to_first_token_seconds_sum", (model,))] == pytest.approx(0.05)
    # second chunk: 40 ms gap carrying 2 tokens -> one ITL observation of 20 ms
    assert s[("pulse_inter_token_latency_seconds_count", (model,))] == 1
    assert s[("pulse_inter_token_latency_seconds_sum", (model,))] == pytest.approx(0.02)
    assert s[("pulse_request_duration_seconds_sum", (model,))] == pytest.approx(0.101)
    assert s[("pulse_prompt_tokens_total", (model,))] == 40 and s[("pulse_cached_prompt_tokens_total", (model,))] == 32
    assert s[("pulse_generated_tokens_total", (model,))] == 3
    assert s[("pulse_draft_tokens_accepted_total", (model,))] == 2
    assert s[("pulse_admission_rejections_total", (("reason", "quota"),))] == 1
    assert s[("pulse_prefix_hit_ratio_sum", ())] == pytest.approx(0.8)
    assert s[("pulse_requests_in_flight", ())] == 0 and s[("pulse_queue_depth", ())] == 1


def test_finish_is_recorded_once_and_models_are_capped():
    m = GatewayMetrics(max_models=2)
    r = m.request("a")
    assert samples(m)[("pulse_requests_in_flight", ())] == 1
    r.finish(200)
    r.finish(500)  # a second finish (e.g. in a `finally` after an explicit one) is ignored
    for name in ("b", "c", "d"):
        m.record_request(name, 200, 0.1)
    s = samples(m)
    assert s[("pulse_requests_in_flight", ())] == 0
    assert ("pulse_requests_total", (("api", "chat"), ("model", "a"), ("status", "500"))) not in s
    assert s[("pulse_requests_total", (("api", "chat"), ("model", "other"), ("status", "200")))] == 2  # c, d past the cap
    assert m.model("zzz") is m.model("other")


def test_worker_collector_reads_snapshots_at_scrape_time():
    snaps = full_snapshots()
    m = GatewayMetrics(worker_snapshots=lambda: snaps)
    s = samples(m)
    assert s[("pulse_worker_kv_blocks_free", (("worker", "w0"),))] == 70
    assert s[("pulse_worker_kv_blocks_free", (("worker", "w1"),))] == 0
    assert s[("pulse_worker_healthy", (("worker", "w1"),))] == 0
    assert s[("pulse_worker_draft_tokens_accepted_total", (("position", "3"), ("worker", "w0")))] == 2
    assert s[("pulse_worker_speculation_steps_total", (("k", "3"), ("worker", "w0")))] == 9
    assert s[("pulse_worker_engine_forwards_total", (("path", "eager"), ("worker", "w0")))] == 7
    assert s[("pulse_worker_engine_forwards_total", (("path", "graph"), ("worker", "w0")))] == 40
    assert s[("pulse_worker_backend_restarts_total", (("worker", "w0"),))] == 2
    # plain BackendStats has no speculation fields: no speculation series for w1
    assert not any(k[0].startswith("pulse_worker_speculation") and ("worker", "w1") in k[1] for k in s)
    snaps["w0"] = BackendStats(running=7)
    del snaps["w1"]
    s = samples(m)
    assert s[("pulse_worker_running_sequences", (("worker", "w0"),))] == 7
    assert not any(("worker", "w1") in k[1] for k in s)


def test_worker_collector_names_the_pipeline_transport():
    snaps = {"p": BackendStats(pipeline_transport="shm", pipeline_transfer_seconds=0.5, pipeline_tokens=1000,
                               pipeline_rebuilds=1), "q": BackendStats()}
    s = samples(GatewayMetrics(worker_snapshots=snaps))
    assert s[("pulse_worker_pipeline_transport", (("transport", "shm"), ("worker", "p")))] == 1
    assert not any(k[0] == "pulse_worker_pipeline_transport" and ("worker", "q") in k[1] for k in s)
    assert s[("pulse_worker_pipeline_rebuilds_total", (("worker", "p"),))] == 1
    assert s[("pulse_worker_pipeline_transfer_seconds_total", (("worker", "p"),))] == 0.5


def test_collector_with_a_plain_dict_registers_and_describes():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector({}))
    with pytest.raises(ValueError, match="Duplicated"):  # describe() names its series up front
        registry.register(WorkerStatsCollector({}))


MULTIPROC = textwrap.dedent("""
    import sys
    from gateway.metrics import GatewayMetrics
    m = GatewayMetrics(worker_snapshots={"w0": {"running": 3}})
    if sys.argv[1] == "serve":
        m.record_request("gemma", 200, 0.5)
    else:
        sys.stdout.write(m.render()[0].decode())
""")


def test_multiprocess_mode_sums_replicas(tmp_path):
    """Two gateway replicas (processes) record; a third one's /metrics shows both, plus worker series."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = [sys.executable, "-c", MULTIPROC]
    for _ in range(2):
        subprocess.run([*run, "serve"], env=env, check=True, timeout=60)
    out = subprocess.run([*run, "render"], env=env, check=True, timeout=60, capture_output=True, text=True).stdout
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(out) for s in f.samples}
    assert values[("pulse_requests_total", (("api", "chat"), ("model", "gemma"), ("status", "200")))] == 2
    assert values[("pulse_request_duration_seconds_count", (("model", "gemma"),))] == 2
    assert values[("pulse_worker_running_sequences", (("worker", "w0"),))] == 3


# --- deploy/: dashboard and configs ----------------------------------------------------------------

PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "clamp_min", "clamp_max",
    "label_values", "topk", "bottomk", "delta", "deriv", "abs", "vector", "scalar", "time", "bool",
}


def labels_of(sample_name: str) -> set[str]:
    m = GatewayMetrics(worker_snapshots=full_snapshots())
    traffic(m)
    return {k for f in exposition(m).values() for s in f.samples if s.name == sample_name for k in s.labels}


def exposed_sample_names() -> set[str]:
    m = GatewayMetrics(worker_snapshots=full_snapshots())
    traffic(m)
    return {s.name for f in exposition(m).values() for s in f.samples}


def metric_names_in(expr: str) -> list[str]:
    """Identifiers of a PromQL expression that are metric names (not functions, keywords or labels)."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)  # label matchers and range selectors
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)  # grouping label lists
    names = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "", bare))
    unknown = [n for n in names if n not in PROMQL_WORDS and not n.startswith("pulse_")]
    assert not unknown, f"unexpected identifiers {unknown} in {expr}"
    return [n for n in names if n.startswith("pulse_")]


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana/dashboards/pulse.json").read_text())


def test_dashboard_queries_use_only_defined_metrics():
    dash, known = dashboard(), exposed_sample_names()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert len(panels) >= 15 and all(p["targets"] for p in panels)
    for var in (v for v in dash["templating"]["list"] if v["type"] == "query"):
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"]).groups()
        assert metric in known and label == var["name"] and label in labels_of(metric), var
    for expr in exprs:
        used = metric_names_in(expr)
        assert used, expr
        assert set(used) <= known, f"{set(used) - known} in {expr}"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("first token", "inter-token", "tokens per second", "queue", "kv", "draft", "cache", "error"):
        assert topic in titles


def test_dashboard_imports_anywhere():
    """No hard-wired data source: panels use the ${datasource} variable, so import needs no mapping."""
    dash = dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ds_vars = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds_vars and ds_vars[0]["query"] == "prometheus"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
            assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def load_yaml(rel: str) -> dict:
    return yaml.safe_load((DEPLOY / rel).read_text())


def test_collector_pipelines_name_defined_components():
    cfg = load_yaml("otel-collector.yaml")
    for kind in ("receivers", "processors", "exporters"):
        for pipeline in cfg["service"]["pipelines"].values():
            assert set(pipeline[kind]) <= set(cfg[kind]), kind
    assert set(cfg["service"]["extensions"]) <= set(cfg["extensions"])
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_prometheus_scrapes_the_gateway():
    cfg = load_yaml("prometheus.yml")
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["pulse"]["metrics_path"] == "/metrics"
    assert jobs["pulse"]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]


def test_compose_wires_the_stack():
    cfg = load_yaml("compose.yaml")
    services = cfg["services"]
    assert {"otel-collector", "prometheus", "grafana", "jaeger"} <= set(services)
    mounts = [v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if v.startswith("./")]
    for path in mounts:
        assert (DEPLOY / path).exists(), path
    assert all(s.get("network_mode") == "host" for s in services.values())
    # the collector forwards to Jaeger on the port Jaeger was moved to
    jaeger_otlp = next(a for a in services["jaeger"]["command"] if a.startswith("--collector.otlp.grpc.host-port"))
    assert load_yaml("otel-collector.yaml")["exporters"]["otlp/jaeger"]["endpoint"] == jaeger_otlp.split("=")[1]
    ds = load_yaml("grafana/provisioning/datasources/pulse.yaml")["datasources"]
    assert {d["type"] for d in ds} == {"prometheus", "jaeger"}
    prov = load_yaml("grafana/provisioning/dashboards/pulse.yaml")["providers"][0]
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("./"))
    assert grafana_mounts["./grafana/dashboards"] == prov["options"]["path"]
