"""When the engine's step thread hands held step outputs to the event loop (workers/cupy/engine_loop.py)."""
import time

import pytest

from workers.cupy.backend import HANDOVER_S_PER_STREAM, handover_due
from workers.cupy.engine import StepOutput
from workers.cupy.engine_loop import EngineLoop

MS = 1e-3


@pytest.mark.parametrize("held_ms,streams,due", [
    (1.9, 1, True),  # one stream: every step
    (1.9, 32, True),  # 32 x 50 us = 1.6 ms: every 1.9 ms step
    (1.9, 64, False),  # 64 streams at 1.9 ms steps: held one step...
    (3.8, 64, True),  # ...handed over after the second
    (50.0, 64, True),  # slow steps (the CPU engine): every step
    (11.4, 256, False),  # 256 streams at 1.9 ms: held six steps...
    (13.3, 256, True),  # ...handed over after the seventh
    (0.0, 0, True),  # a step with no outputs (prefill only) hands over what is held
])
def test_handover_due(held_ms, streams, due):
    assert HANDOVER_S_PER_STREAM == 50e-6  # the table is worked out for this value
    assert handover_due(held_ms * MS, streams) is due


@pytest.mark.parametrize("held_ms,streams,due", [
    (1.6, 8, True),  # 8 x 200 us: every step of 1.6 ms
    (1.9, 16, False),  # 16 streams at 1.9 ms steps: held one step...
    (3.8, 16, True),  # ...handed over after the second
    (49.4, 256, False),  # 256 streams at 1.9 ms: held 26 steps...
    (51.3, 256, True),  # ...handed over after the 27th (51.2 ms)
])
def test_handover_due_with_a_longer_hold(held_ms, streams, due):
    assert handover_due(held_ms * MS, streams, 200e-6) is due


def _step(ids, token):
    return [StepOutput(request_id=rid, token_ids=[token]) for rid in ids]


def test_a_first_token_goes_at_once_alone_and_the_held_outputs_stay_held_in_order():
    handed: list[list[StepOutput]] = []
    loop = EngineLoop(engine=None, emit=handed.append, emit_one=lambda rid, item: None, hold_s_per_stream=50e-6)
    running = [f"r{i}" for i in range(64)]
    loop._handed_at = time.monotonic()  # just handed over: 64 streams hold their outputs 3.2 ms
    loop._keep(_step(running, 1))
    assert handed == []
    loop._fresh.add("new")  # a request admitted meanwhile: its first token comes with the next step
    loop._keep(_step(running + ["new"], 2))
    assert [[o.request_id for o in h] for h in handed] == [["new"]]  # alone, at once
    loop._keep(_step(running + ["new"], 3))  # its second token is held like the others'
    assert len(handed) == 1
    time.sleep(65 * 50e-6)
    loop._keep(_step(running + ["new"], 4))  # due: everything held goes, each request's tokens in order
    assert len(handed) == 2
    tokens: dict[str, list[int]] = {}
    for out in handed[1]:
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert tokens["r0"] == [1, 2, 3, 4] and tokens["r63"] == [1, 2, 3, 4]
    assert tokens["new"] == [3, 4]  # its first token (2) went ahead, alone


def test_the_gc_clock_counts_the_collectors_time_in_this_process():
    import gc

    from workers.cupy.engine_loop import GcClock

    clock = GcClock.installed()
    assert GcClock.installed() is clock and gc.callbacks.count(clock._callback) == 1  # one per process
    before = clock.seconds
    junk = [[i] for i in range(200_000)]  # something for a full collection to walk
    gc.collect()
    del junk
    assert clock.seconds > before
