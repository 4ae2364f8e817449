"""Backend names to classes. Imported lazily so a worker loads only the backend it runs.

Every backend class is built as `cls(config, profile, model, block_sink=..., worker_id=...)` with
`config: policy.config.PulseConfig`, `profile: policy.profiles.DeviceProfile`,
`model: workers.protocol.model.ModelInfo`, `block_sink: workers.protocol.BlockSink | None`.
"""
from __future__ import annotations

import importlib

BACKENDS = {
    "cupy": "workers.cupy.backend:EngineBackend",
    "llama-server": "workers.llama_server.backend:LlamaServerBackend",
    "loadtest": "workers.loadtest:LoadTestBackend",
}


def backend_class(name: str):
    try:
        module, _, attr = BACKENDS[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None
    return getattr(importlib.import_module(module), attr)
