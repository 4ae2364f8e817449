"""The CUDA IPC transport's host-side parts (workers/pipeline/cuda_ipc.py), without a GPU: which hops take it
by placement, when two devices reach each other, the slot bookkeeping that makes event reuse safe, the
shared `taken` counter, and the fallback to host memory when the receiver cannot make a ring (this box has
no CuPy, so that fallback is the real one)."""
from __future__ import annotations

import os
import socket
import sys

import numpy as np
import pytest

from workers.pipeline import cuda_ipc, wire
from workers.pipeline.build import ipc_hops, ring_spec
from workers.pipeline.cuda_ipc import End, IpcIn, IpcOut, SlotBook, TakenCounter, label, plan_hops, reachable
from workers.pipeline.shm import remove_rings

GPU, CPU = "cuda", "cpu"


@pytest.mark.parametrize("ends, want", [
    # driver + 2 stages sharing one GPU host: every hop, the last one back to the driver included
    ([End("127.0.0.1", GPU), End("127.0.0.1", GPU), End("127.0.0.1", GPU)], [True, True, True]),
    ([End("localhost", GPU), End("127.0.0.1", GPU)], [True, True]),  # both loopback: one host
    # stage 1 on another node: the hops into and out of it stay on the host path
    ([End("10.0.0.1", GPU), End("10.0.0.1", GPU), End("10.0.0.2", GPU)], [True, False, False]),
    # a CPU stage between two GPU ends: only GPU-to-GPU hops
    ([End("127.0.0.1", GPU), End("127.0.0.1", CPU), End("127.0.0.1", GPU)], [False, False, True]),
    ([End("127.0.0.1", CPU), End("127.0.0.1", CPU)], [False, False]),
])
def test_hops_take_cuda_ipc_when_both_ends_are_cuda_on_one_host(ends, want):
    assert plan_hops(ends) == want


def test_no_hop_takes_cuda_ipc_when_turned_off_or_without_cupy():
    ends = [End("127.0.0.1", GPU)] * 3
    assert plan_hops(ends, enabled=False) == [False] * 3
    assert plan_hops(ends, cupy_ok=False) == [False] * 3


def test_without_cupy_the_builder_plans_no_cuda_ipc_hop(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError, as on a box without it
    assert cuda_ipc.cupy_or_none() is None and not cuda_ipc.available()
    plan = [("cuda", 0, 9), ("cuda", 9, 18)]
    addresses = [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert ipc_hops(addresses, plan, "127.0.0.1", "cuda", True) == [False] * 3
    assert ipc_hops(addresses, plan, "127.0.0.1", "cpu", True) == [False] * 3


def test_the_transport_name_says_which_hops_are_device_to_device():
    assert label([True, True, True], "shm") == "cuda_ipc"
    assert label([True, False, True], "shm") == "cuda_ipc+shm"
    assert label([False, False], "tcp-loopback") == "tcp-loopback"


def facts(pci, visible=(), peers=(), boot="b1"):
    return {"boot": boot, "pci": pci, "visible": list(visible), "peers": list(peers)}


def test_devices_reach_each_other_when_the_same_or_peers_and_never_across_machines():
    a = facts("0000:01:00.0", ["0000:01:00.0", "0000:02:00.0"], ["0000:02:00.0"])
    same = facts("0000:01:00.0", ["0000:01:00.0"])
    assert reachable(a, same) and reachable(same, a)
    assert reachable(a, facts("0000:02:00.0", ["0000:01:00.0", "0000:02:00.0"]))  # a lists it as a peer
    # visible to this process but not a peer: no
    lone = facts("0000:01:00.0", ["0000:01:00.0", "0000:03:00.0"])
    assert not reachable(lone, facts("0000:03:00.0", ["0000:01:00.0", "0000:03:00.0"]))
    # hidden by CUDA_VISIBLE_DEVICES: cannot be asked here, the opening decides
    assert reachable(facts("0000:01:00.0", ["0000:01:00.0"]), facts("0000:03:00.0", ["0000:03:00.0"]))
    assert not reachable(a, facts("0000:01:00.0", ["0000:01:00.0"], boot="b2"))  # same bus id, other machine


def test_a_slot_is_reused_only_after_its_last_message_was_taken():
    book, taken = SlotBook(3), 0
    slots = []
    for _ in range(3):
        slots.append(book.next_slot(taken))
        book.commit()
    assert slots == [0, 1, 2]
    assert book.next_slot(taken) is None  # slot 0 still holds message 0: the sender goes through the host
    taken = 1
    assert book.next_slot(taken) == 0
    book.commit()
    assert book.next_slot(taken) is None  # slot 1 holds message 1, not taken yet
    taken = 4
    assert [book.next_slot(taken), book.commit(), book.next_slot(taken)] == [1, None, 2]
    with pytest.raises(ValueError):
        SlotBook(0)


def test_a_receiver_in_step_with_the_sender_never_forces_a_fallback():
    """The receiver takes messages in order, each within K - 1 of the sender: every message gets a slot,
    in round-robin order (what IpcRing.take checks against the counter)."""
    book, k, lag = SlotBook(4), 4, 3
    for sent in range(100):
        taken = max(0, sent - lag)
        slot = book.next_slot(taken)
        assert slot == sent % k
        book.commit()


def test_the_taken_counter_is_shared_and_cleaned_up():
    owner = TakenCounter()
    reader = TakenCounter(owner.path)
    try:
        assert reader.value == 0
        owner.bump()
        owner.bump()
        assert reader.value == 2
    finally:
        reader.close()
    assert os.path.exists(owner.path)  # only the owner removes it
    owner.close()
    assert not os.path.exists(owner.path)
    crashed = TakenCounter()  # a receiver that died without closing: removed by its pid, as its shm rings
    remove_rings([os.getpid()])
    assert not os.path.exists(crashed.path)


def test_ring_spec_has_slots_to_spare_and_room_for_a_whole_step():
    slots, nbytes = ring_spec(2, 4096, 640)
    assert slots >= 2 + 2 and nbytes == 4096 * 640 * 4
    assert ring_spec(8, 16, 640)[0] == 10


class DeviceRows:
    """Stands for a CuPy array (this box has none): what IpcOut.pack reads of one, `nbytes` and `get()`."""

    def __init__(self, a: np.ndarray):
        self.a, self.nbytes = a, a.nbytes

    def get(self) -> np.ndarray:
        return self.a


def test_a_receiver_that_cannot_make_a_ring_gets_the_arrays_through_host_memory():
    a, b = socket.socketpair()
    try:
        ipc_in = IpcIn(b, 4, 1 << 20)  # no CuPy here: the ring is not made, the offer says so
        assert ipc_in.ring is None
        out = IpcOut(a)
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        header, arrays, moved = out.pack({"kind": "run"}, {"positions": np.arange(3), "x": DeviceRows(x)})
        assert out.opened and out.sender is None and moved == 0
        assert header == {"kind": "run", "ipc_fb": 1} and np.array_equal(arrays["x"], x)
        # a host array needs no ring at all: passed on as it is, not counted
        assert out.pack({"kind": "run"}, {"x": x}) == ({"kind": "run"}, {"x": x}, 0)
        wire.send(a, header, arrays)
        got_header, got, _, _ = wire.recv(b)
        assert "ipc" not in got_header and ipc_in.unpack(got_header, got) is got
        with pytest.raises(ConnectionError):  # a slot message on a hop whose ring was never made
            ipc_in.unpack({"ipc": {"slot": 0, "dtype": "<f4", "shape": [3, 4]}}, {})
    finally:
        a.close()
        b.close()


def test_the_offer_round_trips_its_handles_as_bytes():
    a, b = socket.socketpair()
    try:
        handle = bytes(range(64))  # an IPC handle is 64 raw bytes, zeros included
        wire.send(a, {"kind": "ipc-ring", "ok": True, "mem": handle, "ready": [handle, handle[::-1]]}, {})
        got, _, _, _ = wire.recv(b)
        assert got["mem"] == handle and got["ready"][1] == handle[::-1]
    finally:
        a.close()
        b.close()


def test_a_sender_never_copies_into_a_receiver_that_is_gone():
    a, b = socket.socketpair()
    cuda_ipc._peer_alive(a)  # open and quiet: fine
    b.close()
    with pytest.raises(ConnectionError):
        cuda_ipc._peer_alive(a)
    a.close()
