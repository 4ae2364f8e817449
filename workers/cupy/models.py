"""Architectures the engine runs, by GGUF `general.architecture`. A new one is a new file plus a line here."""
from __future__ import annotations

from workers.cupy.ops import Ops
from workers.protocol.model import ModelInfo

# architecture -> (module, model class, config class); the GPU model class lives in workers/cupy/gpu/<module>.py
ARCHITECTURES = {
    "gemma3": ("gemma3", "Gemma3", "Gemma3Config"),
    "llama": ("llama", "Llama", "LlamaConfig"),
}


def check_architecture(architecture: str) -> None:
    """ValueError naming the architecture and the supported ones when the engine cannot run it."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"the engine does not run GGUF architecture {architecture!r} (it runs: {', '.join(ARCHITECTURES)}); "
            "llama-server runs many more: serve this model with `pulse serve --backend llama-server`")


def config_for(info: ModelInfo):
    """The model's typed config (e.g. LlamaConfig) from its GGUF header."""
    import importlib

    check_architecture(info.architecture)
    module, _, config = ARCHITECTURES[info.architecture]
    cls = getattr(importlib.import_module(f"workers.cupy.{module}"), config)
    return cls.from_hparams(info.hparams, info.vocab_size)


def build_model(info: ModelInfo, weights: dict, ops: Ops, dtype: str = "float32"):
    """The model object for `info.architecture`: it has `forward(batch, kv)` and `kv_storage(...)`."""
    import importlib

    cfg = config_for(info)
    module, model, _ = ARCHITECTURES[info.architecture]
    return getattr(importlib.import_module(f"workers.cupy.{module}"), model)(cfg, weights, ops, dtype)


def build_gpu_model(info: ModelInfo, weights: dict, **kw):
    """The CUDA model (workers/cupy/gpu/<module>.py, class Gpu<Model>) for `info.architecture`; `kw` go to
    its constructor (act, graph_sizes, max_model_len)."""
    import importlib

    cfg = config_for(info)
    module, model, _ = ARCHITECTURES[info.architecture]
    return getattr(importlib.import_module(f"workers.cupy.gpu.{module}"), f"Gpu{model}")(cfg, weights, **kw)
