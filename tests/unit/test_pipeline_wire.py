"""The pipeline's activation transport on a socket pair: arrays round-trip exactly over the socket and
through the shared-memory ring (large messages), small ones stay on the socket, a full ring falls back to
the socket instead of waiting, and released space is reused."""
from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from workers.pipeline import wire
from workers.pipeline.shm import MIN_BYTES, ShmReader, ShmRing, remove_rings


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def arrays(tokens: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"positions": np.arange(tokens, dtype=np.int32),
            "x": rng.standard_normal((tokens, 640), dtype=np.float32)}


def exchange(pair, header: dict, sent: dict, ring=None, reader=None):
    """Send on one end (in a thread: a large message outgrows the socket buffer) and receive on the other."""
    t = threading.Thread(target=wire.send, args=(pair[0], header, sent, ring))
    t.start()
    got = wire.recv(pair[1], reader)
    t.join()
    return got


def test_arrays_round_trip_on_the_socket(pair):
    sent = arrays(3)
    n = wire.send(pair[0], {"kind": "run", "mb": 1}, sent)
    header, got, m, _ = wire.recv(pair[1])
    assert header == {"kind": "run", "mb": 1} and n == m
    assert all(np.array_equal(got[k], sent[k]) and got[k].dtype == sent[k].dtype for k in sent)


def test_large_messages_go_through_the_ring_small_ones_on_the_socket(pair):
    ring, reader = ShmRing(4 * MIN_BYTES), ShmReader()
    try:
        big, small = arrays(MIN_BYTES // 2560 + 1, 1), arrays(2, 2)
        for sent, through_ring in ((big, True), (small, False)):
            before = ring.written
            _, got, n, _ = exchange(pair, {"kind": "run"}, sent, ring, reader)
            assert (ring.written > before) == through_ring
            assert all(np.array_equal(got[k], sent[k]) for k in sent)
            assert n >= sum(a.nbytes for a in sent.values())
        # the reader has not released: the ring fills and the next big messages go on the socket instead
        for i in range(4):
            header, got, _, _ = exchange(pair, {"kind": "run", "i": i}, big, ring, reader)
            assert header["i"] == i and np.array_equal(got["x"], big["x"])
        before = ring.written
        assert before < 5 * big["x"].nbytes  # not every one of the five big messages fit
        reader.release()
        exchange(pair, {"kind": "run"}, big, ring, reader)  # space handed back: through the ring again
        assert ring.written > before
        del got
    finally:
        reader.close()
        ring.close()
    assert not os.path.exists(ring.path)


def test_rings_of_dead_processes_are_removed():
    ring = ShmRing(1 << 16)  # its process "dies" holding it: the file stays until someone removes it
    assert os.path.exists(ring.path)
    remove_rings([os.getpid()])  # what the launchers do with a dead stage's pid
    assert not os.path.exists(ring.path)
    ring.close()  # and a ring already removed closes quietly
