import pytest
from pydantic import ValidationError

from pulse.cli import SERVE_FLAGS, _overrides, build_parser
from pulse.config import env_overrides, load_config


def test_defaults_are_the_single_box():
    cfg = load_config(environ={})
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    assert cfg.workers.backend is None and cfg.redis.url is None  # None: the device profile's default_backend
    assert [m.name for m in cfg.models] == ["gemma-3-270m", "smollm2-135m-instruct"]


def test_yaml_then_env_then_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("server: {port: 9000, host: 0.0.0.0}\nworkers: {backend: loadtest, count: 2}\n")
    env = {"PULSE_SERVER__PORT": "9100", "PULSE_WORKERS__LOADTEST__TOKENS": "7", "OTHER": "x"}
    cfg = load_config(f, {"workers": {"count": 3}}, environ=env)
    assert cfg.server.port == 9100 and cfg.server.host == "0.0.0.0"
    assert cfg.workers.count == 3 and cfg.workers.loadtest.tokens == 7


def test_unknown_keys_and_bad_values_are_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("server: {prot: 9000}\n")
    with pytest.raises(ValidationError):
        load_config(f, environ={})
    with pytest.raises(ValidationError):
        load_config(None, {"workers": {"backend": "vllm"}}, environ={})
    with pytest.raises(ValidationError):
        load_config(None, environ={"PULSE_SERVER__PORT": "-1"})


def test_flags_map_onto_config_fields():
    args = build_parser().parse_args(["serve", "--port", "8123", "--backend", "loadtest", "--workers", "4",
                                      "--redis-url", "redis://127.0.0.1:1/0"])
    over = _overrides(args, SERVE_FLAGS)
    cfg = load_config(None, over, environ={})
    assert (cfg.server.port, cfg.workers.backend, cfg.workers.count) == (8123, "loadtest", 4)
    assert cfg.redis.url == "redis://127.0.0.1:1/0"


def test_env_values_parse_as_yaml_scalars():
    assert env_overrides({"PULSE_SERVER__RAY_DASHBOARD": "true"}) == {"server": {"ray_dashboard": True}}
