"""The array module the engine computes with: NumPy on a CPU, CuPy on a CUDA GPU, picked once at start.

Everything above this file is written against `xp` (the NumPy API that CuPy mirrors), so CI runs the
same engine code on NumPy that a GPU box runs on CuPy.
"""
from __future__ import annotations

import numpy as np


def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "not here"
        return False


def array_module(device: str):
    """`numpy` for 'cpu', `cupy` for 'cuda'; 'auto' picks cupy when a CUDA device is usable."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return np
    if device == "cuda":
        import cupy

        return cupy
    raise ValueError(f"unknown engine device {device!r}")


def device_name(xp) -> str:
    if xp is np:
        return "cpu"
    props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def to_host(a) -> np.ndarray:
    """A host NumPy array from a NumPy or CuPy array (a copy only when it lives on the device)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)
