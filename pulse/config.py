"""Loading PulseConfig: defaults < YAML file < environment (PULSE_<SECTION>__<FIELD>) < command-line flags."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from policy.config import PulseConfig

ENV_PREFIX = "PULSE_"


def _set(tree: dict, path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def env_overrides(environ: dict[str, str] | None = None) -> dict:
    """PULSE_SERVER__PORT=8001 -> {"server": {"port": 8001}}; values are parsed as YAML scalars."""
    out: dict = {}
    for name, raw in (environ if environ is not None else os.environ).items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        _set(out, path, yaml.safe_load(raw) if raw != "" else None)
    return out


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: dict | None = None,
                environ: dict[str, str] | None = None) -> PulseConfig:
    data: dict = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        data = loaded
    data = merge(data, env_overrides(environ))
    data = merge(data, overrides or {})
    return PulseConfig.model_validate(data)
