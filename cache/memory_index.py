"""The in-process PrefixIndex: the single-box default (one gateway, no Redis).

    index = MemoryPrefixIndex(ttl_s=cfg.routing.block_ttl_s)

Same contract as cache.index.PrefixIndex; it never raises IndexUnavailable. `clock` (seconds, default
time.time) is injectable so tests can step past the TTL without sleeping.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence

from cache.index import ALL_TIERS, PrefixIndex, Tier, tier_mask


class MemoryPrefixIndex(PrefixIndex):
    def __init__(self, ttl_s: float = 600.0, clock: Callable[[], float] = time.time):
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[int, dict[str, tuple[int, float]]] = {}  # hash -> worker -> (tier mask, expires)
        self._by_worker: dict[str, set[int]] = {}
        self._publishes_since_sweep = 0

    SWEEP_EVERY = 4096  # publishes between sweeps of lapsed entries (bounds memory when evictions are lost)

    async def publish(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        self._publish(worker_id, hashes, tier_mask(tier), self._clock())
        self._publishes_since_sweep += 1
        if self._publishes_since_sweep >= self.SWEEP_EVERY:
            self.sweep()

    def sweep(self) -> int:
        """Remove lapsed entries; returns how many went."""
        now, gone = self._clock(), 0
        self._publishes_since_sweep = 0
        for h in list(self._blocks):
            holders = self._blocks[h]
            for w in [w for w, (_, exp) in holders.items() if exp <= now]:
                self._forget(h, holders, w, self._by_worker.get(w))
                gone += 1
        return gone

    async def evict(self, worker_id: str, hashes: Sequence[int], tier: Tier | None = None) -> None:
        clear = tier_mask(tier)
        owned = self._by_worker.get(worker_id)
        for h in hashes:
            holders = self._blocks.get(h)
            if not holders or worker_id not in holders:
                continue
            mask, expires = holders[worker_id]
            mask &= ~clear
            if mask:
                holders[worker_id] = (mask, expires)
            else:
                self._forget(h, holders, worker_id, owned)

    async def drop_worker(self, worker_id: str) -> None:
        for h in self._by_worker.pop(worker_id, set()):
            holders = self._blocks.get(h)
            if holders is not None:
                self._forget(h, holders, worker_id, None)

    async def snapshot(self, worker_id: str, blocks: Mapping[Tier, Sequence[int]]) -> None:
        await self.drop_worker(worker_id)
        now = self._clock()
        for tier, hashes in blocks.items():
            self._publish(worker_id, hashes, tier_mask(tier), now)

    async def longest_prefix(self, hashes: Sequence[int], tiers: Collection[Tier] | None = None) -> dict[str, int]:
        mask = ALL_TIERS if tiers is None else tier_mask(tiers)
        now = self._clock()
        matched: dict[str, int] = {}
        alive: set[str] | None = None  # workers that held every block so far
        for depth, h in enumerate(hashes, start=1):
            holders = self._blocks.get(h, {})
            here = {w for w, (m, exp) in holders.items() if m & mask and exp > now and (alive is None or w in alive)}
            if not here:
                break
            for w in here:
                matched[w] = depth
            alive = here
        return matched

    def _publish(self, worker_id: str, hashes: Sequence[int], mask: int, now: float) -> None:
        expires = now + self.ttl_s
        owned = self._by_worker.setdefault(worker_id, set())
        for h in hashes:
            holders = self._blocks.setdefault(h, {})
            old_mask, old_exp = holders.get(worker_id, (0, 0.0))
            keep = old_mask if old_exp > now else 0  # lapsed tiers do not come back with a new one
            holders[worker_id] = (keep | mask, expires)
            owned.add(h)

    def _forget(self, h: int, holders: dict[str, tuple[int, float]], worker_id: str, owned: set[int] | None) -> None:
        holders.pop(worker_id, None)
        if not holders:
            del self._blocks[h]
        if owned is not None:
            owned.discard(h)

    def __len__(self) -> int:
        """Entries held (block, worker) pairs, lapsed ones included until evicted or dropped."""
        return sum(len(v) for v in self._blocks.values())
