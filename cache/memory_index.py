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
        self._blocks: dict[int, dict[str, int]] = {}  # hash -> worker -> tier mask
        self._by_worker: dict[str, set[int]] = {}
        self._expires: dict[str, float] = {}  # worker -> when its entries lapse
        self._next_sweep = clock() + ttl_s

    async def publish(self, worker_id: str, hashes: Sequence[int], tier: Tier = "gpu") -> None:
        self._lapse_if_expired(worker_id)
        self._publish(worker_id, hashes, tier_mask(tier))
        self._touch(worker_id)

    async def evict(self, worker_id: str, hashes: Sequence[int], tier: Tier | None = None) -> None:
        clear = tier_mask(tier)
        owned = self._by_worker.get(worker_id)
        for h in hashes:
            holders = self._blocks.get(h)
            if not holders or worker_id not in holders:
                continue
            mask = holders[worker_id] & ~clear
            if mask:
                holders[worker_id] = mask
            else:
                self._forget(h, holders, worker_id, owned)
        if owned:
            self._touch(worker_id)

    async def drop_worker(self, worker_id: str) -> None:
        self._drop_now(worker_id)

    async def snapshot(self, worker_id: str, blocks: Mapping[Tier, Sequence[int]]) -> None:
        await self.drop_worker(worker_id)
        for tier, hashes in blocks.items():
            self._publish(worker_id, hashes, tier_mask(tier))
        if self._by_worker.get(worker_id):
            self._touch(worker_id)

    async def longest_prefix(self, hashes: Sequence[int], tiers: Collection[Tier] | None = None) -> dict[str, int]:
        mask = ALL_TIERS if tiers is None else tier_mask(tiers)
        if mask == ALL_TIERS:
            return self._longest_any_tier(hashes)
        return self._longest_in_tiers(hashes, mask)

    def _longest_any_tier(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per worker holding the first block: leading blocks in its set, checked in growing chunks with
        set.issuperset (a C loop), then block by block only inside the chunk that breaks the run."""
        first = self._blocks.get(hashes[0]) if hashes else None
        if not first:
            return {}
        now, out = self._clock(), {}
        for w in first:
            if self._expires.get(w, 0.0) <= now:
                continue
            owned, i, size, n = self._by_worker[w], 0, 16, len(hashes)
            while i < n:
                chunk = hashes[i : i + size]
                if not owned.issuperset(chunk):
                    i += next(k for k, h in enumerate(chunk) if h not in owned)
                    break
                i, size = i + len(chunk), size * 4
            out[w] = i
        return out

    def _longest_in_tiers(self, hashes: Sequence[int], mask: int) -> dict[str, int]:
        now = self._clock()
        matched: dict[str, int] = {}
        alive: set[str] | None = None  # workers that held every block so far
        for depth, h in enumerate(hashes, start=1):
            holders = self._blocks.get(h)
            if not holders:
                break
            if alive is None:
                here = {w for w, m in holders.items() if m & mask and self._expires.get(w, 0.0) > now}
            else:
                here = {w for w in alive if holders.get(w, 0) & mask}
            if not here:
                break
            for w in here:
                matched[w] = depth
            alive = here
        return matched

    def sweep(self) -> list[str]:
        """Forget workers whose entries lapsed; returns their ids. (Lookups already ignore them.)"""
        now = self._clock()
        gone = [w for w, exp in self._expires.items() if exp <= now]
        for w in gone:
            self._drop_now(w)
        return gone

    def _lapse_if_expired(self, worker_id: str) -> None:
        exp = self._expires.get(worker_id)
        if exp is not None and exp <= self._clock():
            self._drop_now(worker_id)  # lapsed entries do not come back with the next publish

    def _drop_now(self, worker_id: str) -> None:
        self._expires.pop(worker_id, None)
        for h in self._by_worker.pop(worker_id, set()):
            holders = self._blocks.get(h)
            if holders is not None:
                self._forget(h, holders, worker_id, None)

    def _touch(self, worker_id: str) -> None:
        now = self._clock()
        self._expires[worker_id] = now + self.ttl_s
        if now >= self._next_sweep:  # free silent workers' memory about once per TTL
            self._next_sweep = now + self.ttl_s
            self.sweep()

    def _publish(self, worker_id: str, hashes: Sequence[int], mask: int) -> None:
        owned = self._by_worker.setdefault(worker_id, set())
        for h in hashes:
            holders = self._blocks.setdefault(h, {})
            holders[worker_id] = holders.get(worker_id, 0) | mask
            owned.add(h)

    def _forget(self, h: int, holders: dict[str, int], worker_id: str, owned: set[int] | None) -> None:
        holders.pop(worker_id, None)
        if not holders:
            del self._blocks[h]
        if owned is not None:
            owned.discard(h)

    def held(self) -> dict[str, int]:
        """Blocks indexed per worker (lapsed ones included until swept)."""
        return {w: len(owned) for w, owned in self._by_worker.items()}

    def __len__(self) -> int:
        """(block, worker) entries held, lapsed ones included until swept."""
        return sum(len(v) for v in self._blocks.values())
