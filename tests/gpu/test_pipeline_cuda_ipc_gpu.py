"""The CUDA IPC ring itself (workers/pipeline/cuda_ipc.py) between two processes, without the model: every
message arrives exactly, in order, through few slots and a receiver that lags (so slots wrap, and messages
the ring cannot take yet go through host memory instead of waiting); the sender overwrites its source
buffer right after each send (the copy is ordered on its stream). On one GPU, and across two GPUs of one
host where there are two."""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

HIDDEN, MESSAGES, SLOTS = 640, 60, 2


def _devices() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def expected(i: int) -> np.ndarray:
    rows = 1 + (i * 7) % 33
    return (np.arange(rows * HIDDEN, dtype=np.float32).reshape(rows, HIDDEN) + 1000.0 * i)


def _receiver(port: int, device: int, lag_s: float) -> None:
    import cupy

    from workers.pipeline import wire
    from workers.pipeline.cuda_ipc import IpcIn

    cupy.cuda.Device(device).use()
    sock = wire.connect("127.0.0.1", port)
    ipc_in = IpcIn(sock, SLOTS, 64 * HIDDEN * 4)
    bad, via_ring = [], 0
    try:
        for i in range(MESSAGES):
            header, arrays, _, _ = wire.recv(sock)
            via_ring += "ipc" in header
            x = ipc_in.unpack(header, arrays)["x"]
            got = cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x
            if header["i"] != i or not np.array_equal(got, expected(i)):
                bad.append(i)
            if i % 3 == 0:
                time.sleep(lag_s)  # fall behind now and then: the sender must not overrun a slot
        wire.send(sock, {"kind": "result", "bad": bad, "via_ring": via_ring}, {})
    finally:
        ipc_in.close()
        sock.close()


def run_pair(device: int, lag_s: float, pace_s: float) -> tuple[dict, int]:
    from workers.pipeline import wire
    from workers.pipeline.cuda_ipc import IpcOut

    lis = wire.listener("127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_receiver, args=(lis.getsockname()[1], device, lag_s))
    proc.start()
    sock, _ = lis.accept()
    lis.close()
    out = IpcOut(wire.tune(sock))
    src = cp.empty((64, HIDDEN), cp.float32)
    fallbacks = 0
    try:
        for i in range(MESSAGES):
            want = expected(i)
            x = src[: want.shape[0]]
            x.set(want)
            header, arrays, _ = out.pack({"kind": "run", "i": i}, {"x": x})
            fallbacks += header.get("ipc_fb", 0)
            wire.send(sock, header, arrays)
            src.fill(-1.0)  # overwritten at once: the ring's copy was launched before, on this stream
            time.sleep(pace_s)
        result, _, _, _ = wire.recv(sock)
    finally:
        out.close()
        sock.close()
        proc.join(timeout=60)
    assert proc.exitcode == 0
    return result, fallbacks


def test_a_paced_sender_moves_every_message_device_to_device_on_one_gpu():
    result, fallbacks = run_pair(0, lag_s=0.0, pace_s=0.002)
    assert result["bad"] == [] and fallbacks == 0 and result["via_ring"] == MESSAGES


def test_a_lagging_receiver_gets_every_message_exactly_some_through_the_host():
    result, fallbacks = run_pair(0, lag_s=0.005, pace_s=0.0)
    assert result["bad"] == []
    assert result["via_ring"] >= SLOTS  # the first messages at least went device to device ...
    assert result["via_ring"] + fallbacks == MESSAGES  # ... the rest through the host: none lost, none waited


@pytest.mark.skipif(_devices() < 2, reason="one GPU only")
def test_messages_cross_the_ring_between_two_gpus_of_one_host():
    result, fallbacks = run_pair(1, lag_s=0.0, pace_s=0.002)
    assert result["bad"] == [] and result["via_ring"] + fallbacks == MESSAGES
    assert result["via_ring"] == MESSAGES
