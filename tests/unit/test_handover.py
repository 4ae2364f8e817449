"""When the engine's step thread hands held step outputs to the event loop (workers/cupy/backend.py)."""
import pytest

from workers.cupy.backend import HANDOVER_S_PER_STREAM, handover_due

MS = 1e-3


@pytest.mark.parametrize("held_ms,streams,first,due", [
    (1.9, 1, False, True),  # one stream: every step
    (1.9, 32, False, True),  # 32 x 50 us = 1.6 ms: every 1.9 ms step
    (1.9, 64, False, False),  # 64 streams at 1.9 ms steps: held one step...
    (3.8, 64, False, True),  # ...handed over after the second
    (1.9, 64, True, True),  # a request's first token goes at once
    (50.0, 64, False, True),  # slow steps (the CPU engine): every step
    (11.4, 256, False, False),  # 256 streams at 1.9 ms: held six steps...
    (13.3, 256, False, True),  # ...handed over after the seventh
    (0.0, 0, False, True),  # a step with no outputs (prefill only) hands over what is held
])
def test_handover_due(held_ms, streams, first, due):
    assert HANDOVER_S_PER_STREAM == 50e-6  # the table is worked out for this value
    assert handover_due(held_ms * MS, streams, first) is due
