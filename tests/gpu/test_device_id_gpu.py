"""workers.actor.device_id on a GPU: the CUDA UUID (what groups workers that share one GPU), stable, and
different for each GPU of the box where it has several."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


def _id_on(gpu: int) -> str:
    code = "from workers.actor import device_id; print(device_id('cuda'))"
    env_code = f"import os; os.environ['CUDA_VISIBLE_DEVICES'] = '{gpu}'; " + code
    return subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_device_id_is_the_gpus_uuid():
    first = _id_on(0)
    assert re.fullmatch(r"gpu-[0-9a-f]{32}|pci-[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}", first), first
    assert _id_on(0) == first
    if cp.cuda.runtime.getDeviceCount() > 1:
        assert _id_on(1) != first
