"""Same-host activation transport: the arrays go through a shared-memory ring, the socket stays the doorbell.

Every hop keeps its TCP socket for the message header (what the step is, where its arrays lie), so the
order of messages, the wake-up of the receiver and the loss of a peer (a closed socket) work exactly as on
the TCP transport; only the payload moves through memory both processes map: the sender copies the
arrays in, the receiver reads them in place and hands the space back when done with them (one copy in
all, against two through the kernel's socket buffers). Used when every stage shares the driver's host
(build.py: transport "shm"); across hosts the payload stays on the socket.

The ring is a file in /dev/shm the sender creates (and removes when its hop closes): 8 bytes written by the
receiver (how far it has handed back) and then the data, each message contiguous. A small message (under
MIN_BYTES: a decode step) goes on the socket whole, and so does one that does not fit
in the free space (the receiver is behind, or a prefill chunk is larger than the ring): a sender never
waits for the ring.
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
# every page mapped up front, in both processes: a page fault per 4 KiB on first touch cost more than the copy
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
RING_BYTES = 32 << 20  # holds a few prefill chunks of a large model's residual stream
# below this a message goes on the socket whole. bench/pipeline.py --wire on the 2-core box: 1 token (2.5 KB)
# was slower through the ring, 8-32 tokens (20-80 KB) no faster, 512 tokens (1.3 MB) 3x faster; end to end,
# decode steps (33-130 KB at batch 8-32) were no faster through the ring. So: prefill chunks take the ring.
MIN_BYTES = 256 << 10


class ShmRing:
    """The sending side of one hop."""

    def __init__(self, capacity: int = RING_BYTES):
        self.path = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _CTRL + capacity)
            self._map = mmap.mmap(fd, _CTRL + capacity, flags=_FLAGS)
        finally:
            os.close(fd)
        self._consumed = np.frombuffer(self._map, np.uint64, 1)
        self.capacity, self.written, self.min_bytes = capacity, 0, MIN_BYTES

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
    """The receiving side: maps each sender's ring on first sight (the path travels in the header). Arrays
    are read in place (no copy); `release` hands their space back once the caller is done with them."""

    def __init__(self):
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray, np.ndarray]] = {}
        self._held: dict[str, int] = {}  # per ring: how far the messages taken so far reach

    def take(self, path: str, start: int, size: int, end: int) -> np.ndarray:
        """The message's bytes, in place in the ring: valid until `release`."""
        if path not in self._maps:
            with open(path, "r+b") as f:
                m = mmap.mmap(f.fileno(), 0, flags=_FLAGS)
            self._maps[path] = (m, np.frombuffer(m, np.uint64, 1), np.frombuffer(m, np.uint8))
        self._held[path] = end
        return self._maps[path][2][_CTRL + start : _CTRL + start + size]

    def release(self) -> None:
        """Every message taken so far is done with: the senders may reuse its space."""
        for path, end in self._held.items():
            self._maps[path][1][0] = end
        self._held.clear()

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        self._held.clear()
        while maps:
            _, (m, consumed, data) = maps.popitem()
            del consumed, data  # the views first: a mapping with views on it cannot close
            try:
                m.close()
            except BufferError:  # arrays still point into it (the caller's): the mapping goes with them
                pass
