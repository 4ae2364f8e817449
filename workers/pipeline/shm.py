"""Same-host activation transport: the arrays go through a shared-memory ring, the socket stays the doorbell.

Every hop keeps its TCP socket for the message header (what the step is, where its arrays lie), so the
order of messages, the wake-up of the receiver and the loss of a peer (a closed socket) work exactly as on
the TCP transport; only the payload moves through memory both processes map, one copy on each side
instead of two through the kernel's socket buffers. Used when every stage shares the driver's host
(build.py: transport "shm"); across hosts the payload stays on the socket.

The ring is a file in /dev/shm the sender creates (and removes when its hop closes): 8 bytes written by the
receiver (how far it has consumed) and then the data, each message contiguous. A message that does not fit
in the free space (the receiver is behind, or one prefill chunk is larger than the ring) goes on the socket
instead, so the sender never waits for the ring.
"""
from __future__ import annotations

import contextlib
import glob
import mmap
import os
import uuid

import numpy as np

_CTRL = 64  # the consumed counter, on its own cache line
_PREFIX = "/dev/shm/pulse-pipe-"
RING_BYTES = 32 << 20  # holds a few prefill chunks of a large model's residual stream


class ShmRing:
    """The sending side of one hop."""

    def __init__(self, capacity: int = RING_BYTES):
        self.path = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _CTRL + capacity)
            self._map = mmap.mmap(fd, _CTRL + capacity)
        finally:
            os.close(fd)
        self._consumed = np.frombuffer(self._map, np.uint64, 1)
        self.capacity, self.written = capacity, 0

    def put(self, arrays: list[np.ndarray]) -> list | None:
        """Copy the arrays into the ring: [path, start, size, end] for the header, or None (no room)."""
        size = sum(a.nbytes for a in arrays)
        pos = self.written % self.capacity
        skip = self.capacity - pos if pos + size > self.capacity else 0  # each message contiguous
        end = self.written + skip + size
        if size > self.capacity or end - int(self._consumed[0]) > self.capacity:
            return None
        start = (pos + skip) % self.capacity
        off = _CTRL + start
        for a in arrays:
            self._map[off : off + a.nbytes] = memoryview(a).cast("B")
            off += a.nbytes
        self.written = end
        return [self.path, start, size, end]

    def close(self) -> None:
        del self._consumed
        self._map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def remove_rings(pids) -> None:
    """Remove the rings of stage processes that ended without closing them (killed, or ended by Ray)."""
    for pid in pids:
        for path in glob.glob(f"{_PREFIX}{int(pid)}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class ShmReader:
    """The receiving side: maps each sender's ring on first sight (the path travels in the header)."""

    def __init__(self):
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray, np.ndarray]] = {}

    def take(self, path: str, start: int, size: int, end: int) -> bytearray:
        """The message's bytes, copied out once; then the sender may reuse their space."""
        if path not in self._maps:
            with open(path, "r+b") as f:
                m = mmap.mmap(f.fileno(), 0)
            self._maps[path] = (m, np.frombuffer(m, np.uint64, 1), np.frombuffer(m, np.uint8))
        _, consumed, data = self._maps[path]
        body = bytearray(data[_CTRL + start : _CTRL + start + size])
        consumed[0] = end
        return body

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        while maps:
            _, (m, consumed, data) = maps.popitem()
            del consumed, data  # the views first: a mapping with views on it cannot close
            m.close()
