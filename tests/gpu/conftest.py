"""GPU tests: every test here is marked `gpu` and skipped where CuPy or a CUDA device is missing."""
from __future__ import annotations

import pytest


def _cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


HAVE_CUDA = _cuda()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not HAVE_CUDA:
                item.add_marker(skip)
