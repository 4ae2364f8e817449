"""workers.actor.device_id: what the gateway groups workers by when it charges device neighbours' queued
prefill (policy/routing.py). The CUDA UUID branch runs on the GPU machine (tests/gpu)."""
from __future__ import annotations

import importlib.util

import pytest

from workers.actor import device_id


def test_cpu_workers_share_the_nodes_cores(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_id("cpu") == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert device_id("cpu") == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy present: the UUID branch answers")
def test_without_cupy_the_gpus_ray_gave_name_the_device(monkeypatch):
    """A llama-server worker's actor has no CuPy: two workers given GPU 3 share it, GPU 2 is another."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    three = device_id("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert three == "cuda-visible-3" and device_id("cuda") == "cuda-visible-2"
