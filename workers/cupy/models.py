"""Architectures the engine runs, by GGUF `general.architecture`. A new one is a new file plus a line here."""
from __future__ import annotations

from workers.cupy.ops import Ops
from workers.protocol.model import ModelInfo


def build_model(info: ModelInfo, weights: dict, ops: Ops, dtype: str = "float32"):
    """The model object for `info.architecture`: it has `forward(batch, kv)` and `kv_storage(...)`."""
    if info.architecture == "gemma3":
        from workers.cupy.gemma3 import Gemma3, Gemma3Config

        return Gemma3(Gemma3Config.from_hparams(info.hparams, info.vocab_size), weights, ops, dtype)
    raise ValueError(f"the engine does not run architecture {info.architecture!r} yet (supported: gemma3)")
