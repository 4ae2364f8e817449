"""How many gateway replicas `pulse serve` starts: configured, else one per four cores, 1 to 8."""
from __future__ import annotations

import pytest

from policy.config import PulseConfig
from pulse.serve import gateway_replicas


@pytest.mark.parametrize("cores, replicas", [(1, 1), (2, 1), (4, 1), (7, 1), (8, 2), (16, 4), (20, 5), (32, 8),
                                             (128, 8)])
def test_default_is_a_quarter_of_the_cores_from_1_to_8(cores, replicas):
    assert gateway_replicas(PulseConfig(), cores) == replicas


def test_configured_count_wins():
    cfg = PulseConfig.model_validate({"server": {"gateway_replicas": 3}})
    assert gateway_replicas(cfg, 2) == 3
    assert gateway_replicas(cfg, 64) == 3


def test_default_reads_this_box():
    assert 1 <= gateway_replicas(PulseConfig()) <= 8


def test_zero_replicas_is_refused():
    with pytest.raises(ValueError):
        PulseConfig.model_validate({"server": {"gateway_replicas": 0}})
