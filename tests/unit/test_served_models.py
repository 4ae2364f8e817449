"""Several models at once: the `models` config, what each worker's config holds, the gateway's catalog."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.errors import APIError
from gateway.models import ModelCatalog, ServedModel
from policy.config import ModelConfig, PulseConfig
from policy.profiles import builtin_profiles
from pulse.config import load_config


def test_no_model_named_serves_both_bundled_models():
    cfg = load_config(environ={})
    assert [(m.name, m.path) for m in cfg.models] == [("gemma-3-270m", None),
                                                     ("smollm2-135m-instruct", "smollm2-135m-instruct")]
    assert cfg.model.name == "gemma-3-270m"


@pytest.mark.parametrize("overrides,env", [
    ({"model": {"path": "/m.gguf", "name": "mine"}}, {}),  # --model / a `model:` section
    ({}, {"PULSE_MODEL__PATH": "/m.gguf", "PULSE_MODEL__NAME": "mine"}),
])
def test_one_model_named_serves_only_it(overrides, env):
    cfg = load_config(overrides=overrides, environ=env)
    assert [(m.name, m.path) for m in cfg.models] == [("mine", "/m.gguf")]


def test_models_list_and_round_trip_through_json():
    cfg = PulseConfig.model_validate({"models": [
        {"name": "a", "path": "/a.gguf", "aliases": ["alpha"], "workers": 2},
        {"name": "b", "path": "smollm2-135m-instruct", "backend": "llama-server"}]})
    assert cfg.model.name == "a"  # `model` is the first served one
    again = PulseConfig.model_validate_json(cfg.model_dump_json())  # what workers and gateways receive
    assert again.models == cfg.models and again.model == cfg.model


def test_a_worker_config_holds_one_model_with_its_backend():
    cfg = PulseConfig.model_validate({"workers": {"backend": "cupy"}, "models": [
        {"name": "a"}, {"name": "b", "path": "smollm2-135m-instruct", "backend": "llama-server"}]})
    a, b = (cfg.for_model(m) for m in cfg.models)
    assert (a.model.name, a.workers.backend, [m.name for m in a.models]) == ("a", "cupy", ["a"])
    assert (b.model.path, b.workers.backend, [m.name for m in b.models]) == ("smollm2-135m-instruct", "llama-server",
                                                                            ["b"])


@pytest.mark.parametrize("models,says", [
    ([{"name": "a"}, {"name": "a", "path": "/x"}], "'a' names both"),
    ([{"name": "a", "aliases": ["b"]}, {"name": "b"}], "'b' names both"),
    ([{"name": "a", "typo": 1}], "Extra inputs are not permitted"),
    ([{"name": "a", "backend": "vllm"}], "backend"),
    ([{"name": "a", "workers": 0}], "workers"),
])
def test_bad_models_config_is_an_error_at_start(models, says):
    with pytest.raises(ValidationError) as e:
        PulseConfig.model_validate({"models": models})
    assert says in str(e.value)


def test_profiles_name_their_default_backend():
    """CPU: llama-server (measured faster there, BENCHMARKS.md); CUDA GPUs: the engine."""
    profiles = builtin_profiles()
    assert profiles["cpu"].default_backend == "llama-server"
    assert {p.default_backend for name, p in profiles.items() if p.kind == "cuda"} == {"cupy"}


@pytest.mark.parametrize("gpu, name, batch, queue", [
    ("NVIDIA H100 80GB HBM3", "h100", 256, 128), ("NVIDIA H100 NVL", "h100", 256, 128),
    ("NVIDIA H200", "h200", 256, 128), ("NVIDIA GeForce RTX 4090", "cuda", 64, 64)])
def test_a_gpu_gets_its_profiles_batch_and_engine_queue(gpu, name, batch, queue):
    """An H100 is no longer served at the generic cuda profile's batch of 64 (half the tok/s past 64 clients,
    BENCHMARKS.md, issue 25); a card without a profile of its own keeps it."""
    from policy.profiles import select_profile

    p = select_profile(gpu, builtin_profiles())
    assert (p.name, p.max_num_seqs, p.worker_queue) == (name, batch, queue)


def test_catalog_finds_models_by_name_or_alias_and_404_lists_what_is_served():
    catalog = ModelCatalog.build(PulseConfig())
    gemma, smol = catalog.models
    assert catalog.get("gemma-3-270m") is gemma and catalog.get("smollm2") is smol
    assert catalog.get("smollm2-135m-instruct") is smol and catalog.default is gemma
    with pytest.raises(APIError) as e:
        catalog.get("gpt-4o")
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
    assert "`gemma-3-270m`" in e.value.message and "`smollm2-135m-instruct`" in e.value.message


class _Worker:
    def __init__(self, model: str, ctx: int):
        from workers.protocol import WorkerInfo

        self.info = WorkerInfo(worker_id=model, url="", backend="x", model=model, context_length=ctx)


def test_each_model_takes_the_context_window_its_workers_serve():
    catalog = ModelCatalog([ServedModel("a", None, str, 8192), ServedModel("b", None, str, 8192)])
    catalog.fit_to_workers([_Worker("a", 4096), _Worker("a", 2048), _Worker("b", 8192)])
    assert [m.context_length for m in catalog.models] == [2048, 8192]


def test_a_worker_holds_only_its_model():
    from gateway.dispatch import holds

    w = _Worker("a", 1)
    assert holds(w, "a") and not holds(w, "b") and holds(w, "")
    assert holds(_Worker("", 1), "b")  # a worker naming no model serves whatever the gateway serves


def test_bundled_model_names_resolve_to_gguf_files():
    from workers.protocol.model import BUNDLED_MODELS, resolve_model_path

    for name in BUNDLED_MODELS:
        path = resolve_model_path(name)
        assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    with pytest.raises(FileNotFoundError, match="bundled models: gemma-3-270m, smollm2-135m-instruct"):
        resolve_model_path("/nonexistent/model.gguf")


def test_model_config_describes_every_field():
    assert all(f.description for f in ModelConfig.model_fields.values())


def test_a_bundled_model_named_alone_is_served_under_its_own_name():
    cfg = load_config(overrides={"model": {"path": "smollm2-135m-instruct"}}, environ={})  # --model smollm2-...
    assert [m.name for m in cfg.models] == ["smollm2-135m-instruct"]
    named = load_config(overrides={"model": {"path": "smollm2-135m-instruct", "name": "chat"}}, environ={})
    assert named.model.name == "chat"


def test_one_server_can_hold_a_gguf_on_each_backend():
    """bench/backend_speed.yaml: the default-backend measurement runs both backends in one `pulse serve`."""
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "bench" / "backend_speed.yaml", environ={})
    by_backend = {(m.path, m.backend) for m in cfg.models}
    assert by_backend == {(p, b) for p in ("gemma-3-270m", "smollm2-135m-instruct") for b in ("cupy", "llama-server")}
    assert {cfg.for_model(m).workers.backend for m in cfg.models} == {"cupy", "llama-server"}


def test_a_models_kv_budget_becomes_its_workers_kv_setting():
    cfg = PulseConfig.model_validate({"workers": {"engine": {"block_size": 32, "kv_blocks": 10},
                                                  "llama_server": {"kv_tokens": 320}},
                                      "models": [{"name": "a", "kv_tokens": 1000}, {"name": "b"}]})
    a, b = (cfg.for_model(m) for m in cfg.models)
    assert (a.workers.engine.kv_blocks, a.workers.llama_server.kv_tokens) == (32, 1000)  # 1000 tokens: 31.25 blocks
    assert (b.workers.engine.kv_blocks, b.workers.llama_server.kv_tokens) == (10, 320)  # none: the workers' own
    with pytest.raises(ValidationError):
        PulseConfig.model_validate({"models": [{"name": "a", "kv_tokens": 8}]})


def test_workers_on_one_box_split_its_cores(monkeypatch):
    """Both bundled models on a 2-core CPU box: two llama-servers of one thread each, not two of two threads."""
    from policy.profiles import builtin_profiles
    from pulse.serve import model_groups
    from workers.llama_server.lane import cpu_threads

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cfg = PulseConfig.model_validate({"workers": {"backend": "llama-server"}})
    groups = model_groups(cfg, 0)
    assert [n for _, n in groups] == [1, 1] and {c.workers.box_workers for c, _ in groups} == {2}
    cpu = builtin_profiles()["cpu"]
    assert {cpu_threads(c.workers.llama_server, cpu, c.workers.box_workers, 1) for c, _ in groups} == {1}
    from workers.llama_server.backend import LlamaServerBackend
    assert {LlamaServerBackend(c, cpu, None).workers_on_box for c, _ in groups} == {2}  # what the worker reads
    assert {c.workers.box_workers for c, _ in model_groups(cfg, 0, one_box=False)} == {None}  # Ray places them
    set_ = PulseConfig.model_validate({"workers": {"backend": "llama-server", "box_workers": 1}})
    assert {c.workers.box_workers for c, _ in model_groups(set_, 0)} == {1}  # a setting wins
