"""The load soak at CI size: 100 concurrent streams for 10 s (after a 5 s warm-up) against a real
`pulse serve --backend loadtest`. The full count (1,000 streams for 60 s) is
`python -m bench.reliability load --streams 1000 --seconds 60` (figures in RELIABILITY.md).

Passes when the only errors are explicit 429s, no process's RSS grew 10% or more over the window, and no
slot or gateway stream is held afterwards.
"""
from __future__ import annotations

import pytest

from bench.faults import record
from bench.reliability import Soak, drive, server_config
from tests.conftest import PulseProcess

pytestmark = pytest.mark.slow

SOAK = Soak(streams=100, seconds=10, warmup_s=5, tokens=8, tokens_per_s=4)  # 2 s per request


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory):
    srv = PulseProcess([], server_config(SOAK), tmp_path_factory.mktemp("pulse-soak")).wait_ready()
    yield srv
    srv.stop()


async def test_load_soak_ci_size(soak_server):
    doc = await drive(soak_server.base, SOAK)
    figures = {k: doc[k] for k in ("requests_measured", "completed_measured", "status_counts", "errors", "memory",
                                   "after", "seconds_until_no_slot_held")}
    record("load_ci", {"soak": SOAK.__dict__, **figures})
    assert not doc["failures"], doc["failures"]
    # each client runs back to back: about seconds / 2 s requests each; a stalled gateway would fall far short
    assert doc["completed_measured"] >= SOAK.streams * SOAK.seconds / 2 / 2, figures
    assert set(doc["memory"]) >= {"gateway", "pulse-worker-0"}
