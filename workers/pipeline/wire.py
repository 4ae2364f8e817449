"""The activation transport between pipeline stages: length-prefixed messages over a TCP socket.

One message is a msgpack header (what the step is, each array's dtype and shape, per-stage timings) and
the arrays' raw bytes, sent with one sendmsg (no copy of the arrays on the sending side) and received into
one buffer (NumPy views on it, no second copy). On a same-host hop the arrays may instead go through a
shared-memory ring (shm.py) and the socket carries the header alone. Loopback on one host, the network
across hosts: the same code, so a Thor + desktop pair runs what CI runs (over `tcp`). Ray only sets the stages up (placement,
addresses); the per-token path never crosses a Ray call, whose ~0.5-1 ms round trip would be paid per
micro-batch per stage.
"""
from __future__ import annotations

import socket
import struct
import time

import msgspec
import numpy as np

_LEN = struct.Struct("!II")  # header bytes, payload bytes
_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


def send(sock: socket.socket, header: dict, arrays: dict[str, np.ndarray], ring=None) -> int:
    """Send one message; returns the bytes moved. `ring` (shm.ShmRing, same-host hops): the arrays go
    through shared memory when it has room, and only the header on the socket."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    header = {**header, "arrays": [[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()]}
    payload = sum(a.nbytes for a in arrays.values())
    use_ring = ring is not None and payload >= ring.min_bytes
    where = ring.put([a for a in arrays.values() if a.nbytes]) if use_ring else None
    if where is not None:
        header["shm"] = where
    head = _enc.encode(header)
    bufs = [_LEN.pack(len(head), 0 if where else payload), head]
    if where is None:
        bufs += [memoryview(a).cast("B") for a in arrays.values() if a.nbytes]
    total = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in bufs)
    sent = sock.sendmsg(bufs)
    if sent < total:  # a partial send (a large prefill chunk on a full socket buffer): finish plainly
        sock.sendall(b"".join(bytes(b) for b in bufs)[sent:])
    return total + (payload if where else 0)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the pipeline peer closed its connection")
        got += k
    return buf


def recv(sock: socket.socket, reader=None) -> tuple[dict, dict[str, np.ndarray], int, float]:
    """One message: (header, arrays by name, bytes read, seconds from its first bytes to its last).
    `reader` (shm.ShmReader): where a header says its arrays are in shared memory, they are views on it,
    valid until the caller's `reader.release()`.

    The seconds leave out the wait for the message to start (the peer computing), so they are the
    transfer's own cost: decoding, copying, and on a real link the payload's time on the wire."""
    n_head, n_payload = _LEN.unpack(_recv_exact(sock, _LEN.size))
    t0 = time.perf_counter()
    header = _dec.decode(_recv_exact(sock, n_head))
    where = header.pop("shm", None)
    if where is not None:
        if reader is None:
            raise ConnectionError("a shared-memory message on a hop without a shared-memory reader")
        body = reader.take(*where)
        n_payload = len(body)
    else:
        body = _recv_exact(sock, n_payload)
    arrays, off = {}, 0
    for name, dtype, shape in header.pop("arrays"):
        dt = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        arrays[name] = np.frombuffer(body, dt, size // dt.itemsize, off).reshape(shape)
        off += size
    return header, arrays, _LEN.size + n_head + n_payload, time.perf_counter() - t0


def listener(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1)
    return sock


def tune(sock: socket.socket) -> socket.socket:
    """No Nagle delay: a decode micro-batch is a few KB and must leave at once."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect(host: str, port: int, timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)
    return tune(sock)
