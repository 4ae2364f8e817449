"""GPU tests: every test here is marked `gpu`; skipped where CuPy or a CUDA device is missing, except
with PULSE_REQUIRE_GPU=1 (set on the GPU machine), where a CuPy or driver error fails the whole suite
instead of turning it into skips."""
from __future__ import annotations

import os

import pytest

REQUIRE_ENV = "PULSE_REQUIRE_GPU"


def _cuda() -> str | None:
    """None when a CUDA device is usable, else why not."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        return None if n > 0 else "no CUDA device"
    except Exception as e:  # no cupy, no driver, no device
        return f"CuPy/CUDA unavailable: {type(e).__name__}: {e}"


WHY_NOT = _cuda()
HAVE_CUDA = WHY_NOT is None


if not HAVE_CUDA and os.environ.get(REQUIRE_ENV, "").lower() in ("1", "true", "yes"):
    # before any test module's importorskip("cupy") can turn this into skips
    raise RuntimeError(f"{REQUIRE_ENV}=1 but the GPU tests cannot run: {WHY_NOT}")


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if "tests/gpu/" in str(i.fspath).replace("\\", "/")]
    skip = pytest.mark.skip(reason=f"needs CuPy and a CUDA GPU ({WHY_NOT})")
    for item in gpu_items:
        item.add_marker(pytest.mark.gpu)
        if not HAVE_CUDA:
            item.add_marker(skip)
