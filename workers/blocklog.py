"""A worker's recent KV block events, numbered, for gateways that keep an in-process prefix index.

On the single box there is no Redis: each gateway pulls `GET /blocks?since=N` from every worker with
its load poll and applies the events to its own index. The log is bounded; a gateway that fell behind
(or a restarted worker) gets `reset: true` and rebuilds that worker's entries from what follows.
With a Redis URL, workers publish to Redis instead (cache/publisher.py) and this log is not used.
"""
from __future__ import annotations

import threading
from collections import deque

from workers.protocol import BlockBatch, BlockEvent


class BlockLog:
    def __init__(self, max_events: int = 8192):
        self._events: deque[tuple[int, BlockEvent]] = deque(maxlen=max_events)
        self._seq = 0
        self._lock = threading.Lock()  # engines emit from their own thread

    def add(self, event: BlockEvent) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, event))

    def since(self, seq: int) -> BlockBatch:
        with self._lock:
            first = self._events[0][0] if self._events else self._seq + 1
            reset = seq > self._seq or seq < first - 1
            start = 0 if reset else seq
            return BlockBatch(self._seq, reset, [e for n, e in self._events if n > start])
