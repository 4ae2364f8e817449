"""When the engine's step thread hands held step outputs to the event loop (workers/cupy/backend.py)."""
import pytest

from workers.cupy.backend import HANDOVER_S_PER_STREAM, handover_due

MS = 1e-3


@pytest.mark.parametrize("held_ms,step_ms,streams,first,due", [
    (1.9, 1.9, 1, False, True),  # one stream: every step
    (1.9, 1.9, 16, False, True),  # 16 x 50 us = 0.8 ms: every step
    (1.9, 1.9, 64, False, False),  # 64 streams at 1.9 ms steps: held one step...
    (3.8, 1.9, 64, False, True),  # ...handed over after the second
    (1.9, 1.9, 64, True, True),  # a request's first token goes at once
    (50.0, 50.0, 64, False, True),  # slow steps (the CPU engine): every step
    (11.4, 1.9, 256, False, False),  # 256 streams: held ~7 steps (12.8 ms)
    (13.3, 1.9, 256, False, True),
    (0.0, 0.0, 0, False, True),
])
def test_handover_due(held_ms, step_ms, streams, first, due):
    assert HANDOVER_S_PER_STREAM == 50e-6  # the table is worked out for this value
    assert handover_due(held_ms * MS, step_ms * MS, streams, first) is due
