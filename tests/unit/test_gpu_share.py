"""How `pulse serve` spreads N workers over the box's GPUs (pulse/serve.py gpu_share): every worker gets a
GPU share Ray can place, and the shares of the workers put on one GPU never exceed it."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from pulse.serve import gpu_share


def test_no_gpu_means_no_share():
    assert gpu_share(4, 0) == 0


def test_one_gpu_each_when_enough():
    assert gpu_share(2, 2) == 1
    assert gpu_share(1, 8) == 1


def test_workers_share_one_gpu_evenly():
    assert gpu_share(4, 1) == 0.25


def test_three_workers_on_two_gpus_fit():
    assert gpu_share(3, 2) == 0.5  # 2/3 each would leave the third worker unplaceable


@given(workers=st.integers(1, 64), gpus=st.integers(1, 16))
def test_every_worker_fits(workers, gpus):
    share = gpu_share(workers, gpus)
    per_gpu = math.floor(1 / share + 1e-9)  # workers of this share that fit on one GPU
    assert per_gpu * gpus >= workers
    assert 0 < share <= 1
