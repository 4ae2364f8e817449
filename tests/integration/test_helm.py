"""The Helm chart: `helm lint`, `helm template` for the default and example values, every rendered object
validated against its schema (Kubernetes' own via kubernetes-validate, the RayService and ServiceMonitor
CRD schemas kept in helm/schemas via jsonschema), and values.schema.json rejecting bad values.

Tools come from helm/tools/install.sh (PyPI only; cached under ~/.cache/pulse/tools).
"""
from __future__ import annotations

import copy
import json
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from policy.config import PulseConfig
from workers.ray_env import CONTROL_PLANE_ENV

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pulse"
EXAMPLES = sorted((ROOT / "helm" / "examples").glob("values-*.yaml"))
CRD_SCHEMAS = {
    ("ray.io/v1", "RayService"): ROOT / "helm" / "schemas" / "rayservice.ray.io-v1.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ROOT / "helm" / "schemas" / "servicemonitor.monitoring.coreos.com-v1.yaml",
}
K8S_FLOOR = "1.27"  # the chart's kubeVersion floor
VALUE_SETS = [None, *EXAMPLES]
IDS = ["default", *(p.stem for p in EXAMPLES)]


@pytest.fixture(scope="session")
def helm() -> str:
    """helm's path, after helm/tools/install.sh (which also installs kubernetes-validate, hence the
    imports of it inside functions: this module must collect on a machine where it is not there yet)."""
    out = subprocess.run(["bash", str(ROOT / "helm" / "tools" / "install.sh")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def render(helm: str, values: Path | None = None, *sets: str) -> list[dict]:
    args = ["template", "pulse", str(CHART), "--namespace", "llm"]
    if values:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    out = run_helm(helm, *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _strict(node):
    """Make a CRD schema reject unknown fields, as the API server's strict field validation does.

    Structural CRD schemas leave `additionalProperties` out (the server prunes unknown fields), so
    without this a misspelt field would pass here and be dropped silently in the cluster."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    doc = yaml.load(CRD_SCHEMAS[(api_version, kind)].read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema = _strict(doc["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict) -> None:
    """Raise when `obj` does not fit its schema (every Kubernetes version we support, for core kinds)."""
    import kubernetes_validate

    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        crd_validator(*key).validate(obj)
        return
    for version in (K8S_FLOOR, kubernetes_validate.latest_version()):
        kubernetes_validate.validate(obj, version, strict=True)


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_lint(helm, values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    out = run_helm(helm, *args)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_every_rendered_object_fits_its_schema(helm, values):
    docs = render(helm, values)
    kinds = by_kind(docs)
    assert {"RayService", "ConfigMap", "StatefulSet", "Service"} <= set(kinds)
    for obj in docs:
        validate(obj)


def test_optional_objects_render_and_validate(helm):
    docs = render(helm, None, "gateway.ingress.enabled=true", "monitoring.serviceMonitor.enabled=true",
                  "opentelemetry.enabled=true", "opentelemetry.headersSecret.name=otel",
                  "modelVolume.enabled=true", "modelVolume.existingClaim=models")
    assert {"Ingress", "ServiceMonitor"} <= set(by_kind(docs))
    for obj in docs:
        validate(obj)


def test_each_object_switches_off(helm):
    docs = render(helm, None, "redis.enabled=false", "gateway.service.enabled=false",
                  "gateway.ingress.enabled=true", "monitoring.serviceMonitor.enabled=true",
                  "networkPolicy.enabled=false")
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "RayService"]
    assert render(helm, None, "rayService.enabled=false", "pulse.configMap.enabled=false",
                  "redis.enabled=false", "gateway.service.enabled=false") == []


def test_validators_reject_bad_objects(helm):
    """The schema checks above can fail: a wrong type, an unknown field, a missing field."""
    import kubernetes_validate

    kinds = by_kind(render(helm))
    rs = copy.deepcopy(kinds["RayService"][0])
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate(rs)
    rs = copy.deepcopy(kinds["RayService"][0])
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containerz"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate(rs)
    sts = copy.deepcopy(kinds["StatefulSet"][0])
    del sts["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(sts)


def test_pulse_config_is_valid_and_carries_the_worker_layout(helm):
    for values, device, count in [(None, "cuda", 1), *((p, p.stem.split("-")[1], None) for p in EXAMPLES)]:
        kinds = by_kind(render(helm, values))
        cfg = PulseConfig.model_validate(yaml.safe_load(kinds["ConfigMap"][0]["data"]["pulse.yaml"]))
        assert (cfg.server.host, cfg.server.port, cfg.server.ray_address) == ("0.0.0.0", 8000, "auto")
        assert cfg.workers.resources == {device: 1} and cfg.workers.device_profile == device
        group = kinds["RayService"][0]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
        assert group["groupName"] == device and cfg.workers.count == group["replicas"]
        if count is not None:
            assert cfg.workers.count == count


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_worker_groups_hold_one_gpu_and_name_their_device(helm, values):
    spec = by_kind(render(helm, values))["RayService"][0]["spec"]["rayClusterConfig"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        # KubeRay hands this to `ray start --resources=...` through a shell: a quoted JSON object.
        raw = group["rayStartParams"]["resources"]
        assert json.loads(json.loads(raw)) == {group["groupName"]: 1}


def ray_containers(rs: dict) -> list[dict]:
    spec = rs["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["containers"]]


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=lambda v: v.name if v else "default")
def test_ray_pods_run_the_control_plane_as_pulse_serve_does(helm, values):
    """Ray's processes in every pod get workers/ray_env.py's CONTROL_PLANE_ENV (no idle worker prestarted a core,
    the Serve controller's round a second), as under `pulse serve`; pulse.extraEnv, listed after, overrides."""
    containers = ray_containers(by_kind(render(helm, values))["RayService"][0])
    assert len(containers) >= 2
    for c in containers:
        env = env_of(c)
        assert {k: env[k].get("value") for k in CONTROL_PLANE_ENV if k in env} == CONTROL_PLANE_ENV, c["name"]
    rs = by_kind(render(helm, None, "pulse.extraEnv[0].name=RAY_prestart_worker_first_driver",
                       "pulse.extraEnv[0].value=on"))["RayService"][0]
    for c in ray_containers(rs):
        assert env_of(c)["RAY_prestart_worker_first_driver"]["value"] == "on"  # the later entry is the one used


def test_network_policy_admits_only_gateway_and_ray_peers_to_workers(helm):
    kinds = by_kind(render(helm, None, "networkPolicy.extraIngress[0].ports[0].port=8080"))
    policy = kinds["NetworkPolicy"][0]
    validate(policy)
    cluster = kinds["RayService"][0]["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    worker = cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    selects = lambda selector, labels: selector["matchLabels"].items() <= labels.items()  # noqa: E731
    assert selects(policy["spec"]["podSelector"], worker) and not selects(policy["spec"]["podSelector"], head)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = policy["spec"]["ingress"][0]["from"]
    assert any(selects(p["podSelector"], head) for p in peers)
    # no rule admits everyone: each names pods of this release, or is one the values added
    assert all(p["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "pulse" for p in peers)
    assert policy["spec"]["ingress"][1] == {"ports": [{"port": 8080}]}


def test_redis_password_by_reference_only(helm):
    default = by_kind(render(helm))
    secret = default["Secret"][0]
    head = default["RayService"][0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = head["containers"][0]["env"]
    names = [e["name"] for e in env]
    # Kubernetes expands $(VAR) only from variables defined earlier in the list.
    assert names.index("PULSE_REDIS_PASSWORD") < names.index("PULSE_REDIS__URL")
    assert env_of(head["containers"][0])["PULSE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert "$(PULSE_REDIS_PASSWORD)@pulse-redis:6379" in env_of(head["containers"][0])["PULSE_REDIS__URL"]["value"]
    assert "redis" not in yaml.safe_load(default["ConfigMap"][0]["data"]["pulse.yaml"])

    thor = by_kind(render(helm, ROOT / "helm" / "examples" / "values-thor.yaml"))
    assert "Secret" not in thor  # existingSecret: the chart makes none
    redis = thor["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(redis)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "pulse-redis", "key": "redis-password"}


def test_serve_config_is_a_ray_serve_config(helm):
    from ray.serve.schema import ServeDeploySchema

    rs = by_kind(render(helm))["RayService"][0]
    serve_cfg = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    assert [a.import_path for a in serve_cfg.applications] == ["pulse.serve_app:app"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    # KubeRay probes Serve's proxy on the port named "serve"; Pulse's gateway has its own.
    assert ports["serve"] == serve_cfg.http_options.port != ports["http"] == 8000
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}

    # deploy/serve_config.yaml (serve run / serve deploy) runs the same application as the chart,
    # with `pulse serve`'s choices: no Serve proxy, no Serve route.
    local = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text()))
    assert [(a.name, a.import_path) for a in local.applications] == [(a.name, a.import_path) for a in serve_cfg.applications]
    assert local.proxy_location.value == "Disabled" and local.applications[0].route_prefix is None


@pytest.mark.parametrize("bad, where", [
    ("rayService.workerGroups.cuda.replicas=-1", "replicas"),
    ("pulse.config.workers.backend=vllm", "backend"),
    ("pulse.config.workers.bogus=1", "bogus"),
    ("pulse.config.server.port=70000", "port"),
    ("rayService.workerGroups.GB10.enabled=true", "GB10"),
    ("redis.persistence.size=lots", "size"),
    ("unknownTopLevel=1", "unknownTopLevel"),
])
def test_values_schema_rejects_bad_values(helm, bad, where):
    out = run_helm(helm, "template", "pulse", str(CHART), "--set", bad)
    assert out.returncode != 0
    assert "schema" in out.stderr and where in out.stderr, out.stderr


def test_replica_bounds_are_checked(helm):
    out = run_helm(helm, "template", "pulse", str(CHART), "--set", "rayService.workerGroups.cuda.replicas=3")
    assert out.returncode != 0 and "minReplicas <= replicas <= maxReplicas" in out.stderr, out.stderr


def test_values_schema_matches_pulse_config():
    out = subprocess.run(["python", str(ROOT / "helm" / "tools" / "values_schema.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
